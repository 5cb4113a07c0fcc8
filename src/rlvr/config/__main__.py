"""`python -m rlvr.config` prints the settings reference (docs/settings.md)."""

from rlvr.config.reference import settings_markdown

print(settings_markdown())
