"""The settings reference, read from the sections' own source (names, defaults, comments), so that
`rlvr train --help` and docs/settings.md cannot drift from the code: `python -m rlvr.config`."""

from __future__ import annotations

import inspect
import re

from rlvr import trl_settings
from rlvr.config.schema import Config


def describe_settings() -> list[tuple[str, str, str, str]]:
    """(section, name, default, help) for every setting, in Config's order."""
    rows, section = [], ""
    for cls in reversed(Config.__mro__):
        if "_rules" not in cls.__dict__:  # a section made of others, or not a section
            continue
        for line in inspect.getsource(cls).splitlines():
            header = re.match(r"\s{4}# --- (\w[\w -]*?) -+$", line)
            field_line = re.match(r"\s{4}(\w+): [^=]+= (.+?)(?:\s+#\s*(.*))?$", line)
            if header:
                section = header.group(1)
            elif field_line:
                name, default, help_text = field_line.groups()
                rows.append((section, name, default.replace("field(default_factory=dict)", "{}"), help_text or ""))
    return rows


def settings_markdown() -> str:
    """The configuration reference as a Markdown table, then what rlvr does with TRL's other settings."""
    out, section = ["| setting | default | meaning | from |", "|---|---|---|---|"], None
    for sec, name, default, help_text in describe_settings():
        if sec != section:
            out.append(f"| **{sec}** | | | |")
            section = sec
        origin = "TRL" if name in trl_settings.TRL_NAMES else "rlvr"
        out.append(f"| `{name}` | `{default}` | {help_text.replace('|', '&#124;')} | {origin} |")
    return "\n".join(out) + "\n\n" + trl_settings.other_settings_markdown()


def defaults_markdown() -> str:
    """The settings whose default is deliberately not TRL's, with why (trl_settings.TRL_DEFAULTS_DIFFER)."""
    rows = ["| setting | TRL 1.16 | rlvr | why |", "|---|---|---|---|"]
    for name, (trl, why) in trl_settings.TRL_DEFAULTS_DIFFER.items():
        rows.append(f"| `{name}` | `{trl!r}` | `{getattr(Config(), name)!r}` | {why} |")
    return "\n".join(rows)
