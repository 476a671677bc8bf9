import pytest

from confit import load, parse

SAMPLE = """
# service settings
name = demo
port = 8080
debug = yes
ratio = 0.5
"""


def test_parse_types():
    assert parse(SAMPLE) == {"name": "demo", "port": 8080, "debug": True, "ratio": 0.5}


def test_bad_line_names_the_line():
    with pytest.raises(ValueError, match="line 2"):
        parse("a = 1\nnot a setting")


def test_env_overrides_file(tmp_path):
    path = tmp_path / "app.conf"
    path.write_text(SAMPLE)
    assert load(path, environ={"APP_NAME": "prod", "OTHER": "x"})["name"] == "prod"
