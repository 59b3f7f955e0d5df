"""The Redis password comes from a file only its owner may read, or from an inherited pipe;
anything else is refused with what to do (`gpusched.redis_client`)."""

from __future__ import annotations

import os

import pytest

from gpusched.redis_client import PASSWORD_FILE_ENV, SecretFileError, read_secret, redis_password, without_password


def test_an_owner_only_file_is_read_and_one_others_may_read_is_refused(tmp_path):
    path = tmp_path / "pw"
    path.write_text("s3cret\n")
    path.chmod(0o644)
    with pytest.raises(SecretFileError, match=r"has mode 0644: group or others may read or change it; it must be "
                                              r"0600 \(chmod 600 .*pw\)"):
        read_secret(path)
    path.chmod(0o600)
    assert read_secret(path) == "s3cret"


def test_an_empty_or_missing_file_is_refused(tmp_path):
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "empty").chmod(0o600)
    with pytest.raises(SecretFileError, match="is empty"):
        read_secret(tmp_path / "empty")
    with pytest.raises(SecretFileError, match="No such file"):
        read_secret(tmp_path / "absent")


def test_an_inherited_pipe_is_read_once_and_closed():
    read, write = os.pipe()
    os.write(write, b"piped\n")
    os.close(write)
    assert read_secret(f"/dev/fd/{read}") == "piped"
    with pytest.raises(OSError):
        os.fstat(read)  # no copy stays open for a child to inherit
    assert read_secret(f"/dev/fd/{read}") == "piped"  # the process keeps what it read


def test_a_password_given_twice_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "pw"
    path.write_text("a")
    path.chmod(0o600)
    monkeypatch.setenv(PASSWORD_FILE_ENV, str(path))
    assert redis_password("redis://127.0.0.1:1/0") == "a"
    with pytest.raises(SecretFileError, match="give it once"):
        redis_password("redis://:b@127.0.0.1:1/0")


def test_without_password_keeps_everything_else():
    assert without_password("redis://:pw@127.0.0.1:6379/0") == ("redis://127.0.0.1:6379/0", "pw")
    assert without_password("redis://user:pw@h:1/2") == ("redis://user@h:1/2", "pw")
    assert without_password("redis://h:1/0") == ("redis://h:1/0", None)
    assert without_password("redis+sentinel://:pw@s0:26379,s1:26379/mymaster/0") == \
        ("redis+sentinel://s0:26379,s1:26379/mymaster/0", "pw")
