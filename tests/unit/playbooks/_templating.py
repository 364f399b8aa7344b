"""What the playbook and role tests share: the repository root, and ansible-core's templating of trusted text."""
import os

from ansible.plugins.loader import init_plugin_loader

try:    # ansible-core 2.19 templates only what is trusted as a template; the collection's own text is
    from ansible.template import trust_as_template
except ImportError:     # 2.16-2.18 template any string
    def trust_as_template(text):
        return text

# ansible-core 2.16-2.18 find no lookup (ansible.builtin.env) until the loader is set up, which another test file
# may or may not have done first in this worker (pytest-xdist): set it up here
init_plugin_loader()

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))

__all__ = ["REPO", "trust_as_template"]
