"""The state directory: init, join, load, save, modes and the errors that say how to fix them."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from p2pswarm.errors import ConfigError
from p2pswarm.home import Home
from p2pswarm.security import Keyring, SwarmSecret

SECRET = SwarmSecret(bytes(range(32)))
OTHER_SECRET = SwarmSecret(bytes(range(100, 132)))


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def home(tmp_path: Path) -> Home:
    return Home(tmp_path / "p2pswarm-home")


def test_init_creates_private_directory_and_files(home: Home) -> None:
    secret = home.init()
    assert mode(home.path) == 0o700
    assert mode(home.keyring_path) == 0o600
    assert mode(home.identity_path) == 0o600
    keyring = home.load_keyring()
    assert keyring.secrets == (secret,)
    assert keyring.primary.secret == secret
    assert home.load_identity() == home.load_identity()  # made once, then read back
    assert [p.name for p in home.path.iterdir()].count("keyring.json") == 1
    assert not [p for p in home.path.iterdir() if p.name.endswith(".tmp")]


def test_init_with_a_given_secret(home: Home) -> None:
    assert home.init(SECRET) == SECRET
    assert home.load_keyring().secrets == (SECRET,)


def test_init_refuses_to_replace_a_swarm_unless_forced(home: Home) -> None:
    home.init(SECRET)
    identity = home.load_identity()
    with pytest.raises(ConfigError, match="already holds a swarm; use --force to replace it"):
        home.init(OTHER_SECRET)
    assert home.load_keyring().secrets == (SECRET,)
    home.init(OTHER_SECRET, force=True)
    assert home.load_keyring().secrets == (OTHER_SECRET,)
    assert home.load_identity() == identity  # the node id survives a new swarm


def test_join_writes_the_tokens_secret(home: Home) -> None:
    token = SECRET.token()
    keyring = home.join_swarm(SwarmSecret.from_token(token))
    assert keyring.secrets == (SECRET,)
    assert home.load_keyring().secrets == (SECRET,)
    assert mode(home.identity_path) == 0o600
    identity = home.load_identity()
    home.join_swarm(SECRET)  # joining again changes nothing
    assert home.load_identity() == identity
    with pytest.raises(ConfigError, match="already holds another swarm; to leave it and join "
                                          "this one, run join again with --force"):
        home.join_swarm(OTHER_SECRET)
    home.join_swarm(OTHER_SECRET, force=True)
    assert home.load_keyring().secrets == (OTHER_SECRET,)


def test_save_keyring_keeps_order_and_primary(home: Home) -> None:
    home.init(SECRET)
    keyring = home.load_keyring()
    new_id = keyring.install(OTHER_SECRET)
    keyring.use(new_id)
    home.save_keyring(keyring)
    loaded = home.load_keyring()
    assert loaded.secrets == (SECRET, OTHER_SECRET)
    assert loaded.primary_key_id == new_id
    assert mode(home.keyring_path) == 0o600


def test_missing_home_says_how_to_start(home: Home) -> None:
    expected = f"no swarm in {home.path}: run `p2pswarm init` or `p2pswarm join --token ...`"
    for call in (
        home.load_keyring,
        home.load_identity,
        lambda: home.save_keyring(Keyring([SECRET])),
    ):
        with pytest.raises(ConfigError) as info:
            call()
        assert str(info.value) == expected
    home.path.mkdir()
    with pytest.raises(ConfigError) as info:
        home.load_keyring()
    assert str(info.value) == expected


def test_identity_is_created_when_missing(home: Home) -> None:
    home.path.mkdir(mode=0o700)
    identity = home.load_identity()
    assert mode(home.identity_path) == 0o600
    assert home.load_identity() == identity


@pytest.mark.parametrize("file_mode", [0o644, 0o640, 0o604, 0o660, 0o606])
@pytest.mark.parametrize("which", ["keyring_path", "identity_path"])
def test_key_files_open_to_others_are_refused(home: Home, which: str, file_mode: int) -> None:
    home.init(SECRET)
    path: Path = getattr(home, which)
    os.chmod(path, file_mode)
    load = home.load_keyring if which == "keyring_path" else home.load_identity
    with pytest.raises(ConfigError) as info:
        load()
    what = "readable" if file_mode & 0o044 else "writable"
    assert str(info.value) == (
        f"{path} is {what} by other users (mode {file_mode:04o}); run: chmod 600 {path}"
    )


def test_damaged_files_are_reported(home: Home) -> None:
    home.init(SECRET)
    home.keyring_path.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        home.load_keyring()
    document = {
        "format": "p2pswarm-keyring",
        "version": 1,
        "primary_key_id": "00000000",
        "secrets": [SECRET.token()],
    }
    home.keyring_path.write_text(json.dumps(document))
    with pytest.raises(ConfigError, match="not a usable keyring"):
        home.load_keyring()
    home.keyring_path.write_text(json.dumps({**document, "version": 9}))
    with pytest.raises(ConfigError, match="format version 9"):
        home.load_keyring()
    home.identity_path.write_text(json.dumps({"format": "p2pswarm-keyring"}))
    with pytest.raises(ConfigError, match="is not a p2pswarm-identity file"):
        home.load_identity()


def test_forget_swarm_removes_only_the_keyring_this_run_wrote(tmp_path: Path) -> None:
    home = Home(tmp_path / "home")
    home.join_swarm(SwarmSecret(bytes(range(32))))
    written = home.written_keyring()
    assert written is not None
    # another run replaced it since: not ours to delete
    home.join_swarm(SwarmSecret(bytes(range(1, 33))), force=True)
    assert not home.forget_swarm(written) and home.has_swarm()
    mine = home.written_keyring()
    assert mine is not None and home.forget_swarm(mine) and not home.has_swarm()
    assert not home.forget_swarm(mine)  # gone already: nothing to do
