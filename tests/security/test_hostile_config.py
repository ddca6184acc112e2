"""Security conformance, the third red-team pass, finding 8: a hostile config file.

Each file is checked as `kvgate check-config` checks it (in process): exit 2, one short
problem line on stderr naming what is wrong, no traceback, no secret and no long value
printed. Every row failed on the code before these fixes and passes now.
"""

from __future__ import annotations

import pytest

from kvgate.cli import main

PASSWORD = "s3cret-pw-Jd71"


def alias_bomb(levels: int) -> str:
    """Each level's list holds the one before it nine times: 9^levels strings from ~55 bytes a level."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [{','.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


HOSTILE = {
    # the pass used 7 levels (386 bytes, 21 s and 1.2 GB); 4 keep a failing run short
    "alias_bomb": (alias_bomb(4), "aliases"),
    "alias_in_a_setting": ("x: &k 30\nlimits: {body_timeout_sec: *k}\n", "aliases"),
    "deep_nesting": ("a: " + "[" * 5000 + "]" * 5000 + "\n", "nested deeper"),
    "deep_mapping": ("a: " + "{b: " * 3000 + "1" + "}" * 3000 + "\n", "nested deeper"),
    "5000_digit_int": ("listen:\n  port: " + "9" * 5000 + "\n", "cannot be read"),
    "not_utf8": (b"gate:\n  mode: \xe9\xff\n", "not UTF-8"),
    "nan": ("gate:\n  high_watermark: .nan\n", "gate.high_watermark: must be a finite number"),
    "inf": ("limits:\n  body_timeout_sec: .inf\n", "limits.body_timeout_sec: must be a finite number"),
    "duplicate_section": ("gate:\n  mode: enforce\ngate:\n  mode: off\n", "given twice"),
    "duplicate_key": ("listen:\n  port: 1\n  port: 2\n", "given twice"),
    "url_password": (f"replicas:\n  - name: r\n    url: http://admin:{PASSWORD}@10.0.0.1:8000\n", "user info"),
    "5_mb_gate_id": ("ownership:\n  gate_id: " + "x" * 5_000_000 + "\n", "ownership.gate_id"),
    "long_unknown_key": ("k" * 1000 + ": 1\n", "unknown key"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_e8_a_hostile_config_is_one_line_and_exit_2(name, tmp_path, capsys):
    content, expected = HOSTILE[name]
    path = tmp_path / "hostile.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    assert main(["check-config", str(path)]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], err[:500]
    assert len(lines[0]) < 400 and PASSWORD not in err and "Traceback" not in err
