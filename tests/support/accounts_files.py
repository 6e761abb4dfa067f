"""Accounts files for tests: a file written where a variable will name it, and the file of
two accounts that share one environment and API key."""

from __future__ import annotations

from pathlib import Path


def write_file(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def two_accounts_of_one_key(tmp_path: Path, secret_file: Path, second_url: str) -> Path:
    entry = f'environment = "sandbox"\napi_key = "shared-key"\napi_secret_file = "{secret_file}"'
    return write_file(
        tmp_path / "accounts.toml",
        f'[accounts.shop-a]\n{entry}\nbase_url = "http://127.0.0.1:8480"\n\n'
        f'[accounts.shop-b]\n{entry}\nbase_url = "{second_url}"\n',
    )
