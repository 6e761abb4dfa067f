"""Files named by ``*_FILE`` variables: one reader, whose errors name the variable and the
path and never show the file's content."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from merchant_tasks.exceptions import ConfigurationError
from merchant_tasks.settings import Settings
from merchant_tasks.store.sealing import codec_for
from merchant_tasks.variable_files import permission_bits, read_file, read_text_file

CONTENT = "s3cr3t-content-9f1e"


def test_a_path_that_cannot_be_read_is_the_same_error_for_text_files_and_key_files(
    tmp_path: Path,
) -> None:
    directory = str(tmp_path)  # a directory: present, but not a readable file
    expected = "^{}: " + re.escape(f"cannot read {directory} (Is a directory)") + "$"
    with pytest.raises(ConfigurationError, match=expected.format("MERCHANT_API_SECRET_FILE")):
        Settings.from_env({"MERCHANT_API_KEY": "k", "MERCHANT_API_SECRET_FILE": directory})
    with pytest.raises(ConfigurationError, match=expected.format("MERCHANT_TOKEN_KEY_FILE")):
        codec_for(directory)
    with pytest.raises(ConfigurationError, match=r"^X_FILE: cannot read .*missing"):
        permission_bits("X_FILE", tmp_path / "missing")


def test_errors_about_a_files_content_never_show_it(tmp_path: Path) -> None:
    path = tmp_path / "value"
    path.write_bytes(b"\xff" + CONTENT.encode())
    with pytest.raises(ConfigurationError, match=r"X_FILE: .* is not UTF-8 text") as caught:
        read_text_file("X_FILE", path)
    assert CONTENT not in str(caught.value)
    assert read_file("X_FILE", path) == b"\xff" + CONTENT.encode()
    path.write_text(CONTENT + "\n")
    with pytest.raises(ConfigurationError, match=r"MERCHANT_TOKEN_KEY_FILE: .*nothing else") as key:
        codec_for(str(path))
    assert CONTENT not in str(key.value)
    assert read_text_file("X_FILE", path) == CONTENT
