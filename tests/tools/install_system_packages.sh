#!/usr/bin/env bash
# Installs the Debian packages the tests need, without starting any service:
# policy-rc.d refuses every start, so installing openssh-server leaves no sshd running.
set -euo pipefail
missing=()
for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "system packages: all present"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "system packages missing (${missing[*]}); run as root" >&2
    exit 1
fi
policy=/usr/sbin/policy-rc.d
had_policy=0
[ -e "$policy" ] && had_policy=1
if [ $had_policy -eq 0 ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy"
    chmod +x "$policy"
    trap 'rm -f "$policy"' EXIT
fi
echo "system packages: installing ${missing[*]}"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
