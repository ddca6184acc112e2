"""The credential plumbing behind the conformance table: secret files, client keys, which
replicas get kvgate's keys (pure functions and the config loader)."""

from __future__ import annotations

import pytest

from kvgate.proxy.client_auth import ClientAuth, gets_credentials
from kvgate.proxy.config import ConfigError, load_settings
from kvgate.wire.replica_auth import ReplicaKeyError, allowed, replica_key_from_env


def test_secret_files_are_read_into_the_keys_they_stand_for(tmp_path):
    (tmp_path / "up").write_text("# the vLLM key\nsk-up\n")
    (tmp_path / "rep").write_text("rk-1\n")
    (tmp_path / "clients").write_text("c1\n\n# retired: c0\nc2\n")
    config = tmp_path / "kvgate.yaml"
    config.write_text(
        f"upstream: {{api_key_file: {tmp_path / 'up'}, replica_api_key_file: {tmp_path / 'rep'}}}\n"
        f"auth: {{api_keys: [c0], api_keys_file: {tmp_path / 'clients'}}}\n"
    )
    settings = load_settings(config, {})
    assert (settings.upstream.api_key, settings.upstream.replica_api_key) == ("sk-up", "rk-1")
    assert settings.auth.api_keys == ("c0", "c1", "c2")


@pytest.mark.parametrize(
    "yaml_text, problem",
    [
        ("upstream: {api_key: a, api_key_file: FILE}", "upstream.api_key_file: upstream.api_key is set too"),
        ("upstream: {replica_api_key_file: /nonexistent/key}", "upstream.replica_api_key_file: cannot read"),
        ("auth: {api_keys_file: EMPTY}", "auth.api_keys_file: "),
        ("upstream: {api_key_file: TWO}", "holds 2 keys"),
    ],
)
def test_secret_file_problems_name_the_key(tmp_path, yaml_text, problem):
    (tmp_path / "key").write_text("k\n")
    (tmp_path / "empty").write_text("\n# nothing\n")
    (tmp_path / "two").write_text("k1\nk2\n")
    config = tmp_path / "kvgate.yaml"
    text = yaml_text.replace("EMPTY", str(tmp_path / "empty")).replace("TWO", str(tmp_path / "two"))
    config.write_text(text.replace("FILE", str(tmp_path / "key")))
    with pytest.raises(ConfigError) as err:
        load_settings(config, {})
    assert any(problem in line for line in err.value.problems), err.value.problems
    assert not any("k1" in line for line in err.value.problems)


def test_client_keys_bearer_or_x_api_key():
    auth = ClientAuth(["k1", "k2"])
    assert auth.enabled and not ClientAuth([]).enabled
    assert auth.allows({"authorization": "Bearer k2"}) and auth.allows({"authorization": "bearer k1"})
    assert auth.allows({"x-api-key": "k1"})
    for headers in ({}, {"authorization": "k1"}, {"authorization": "Bearer k"}, {"x-api-key": "k12"}):
        assert not auth.allows(headers), headers


def test_run_time_replicas_get_credentials_only_on_listed_hosts():
    assert gets_credentials("http://VLLM-0.vllm:8000", ["vllm-0.vllm"])
    assert not gets_credentials("http://attacker:8000", ["vllm-0.vllm"])
    assert not gets_credentials("http://vllm-0.vllm.attacker:8000", ["vllm-0.vllm"])
    assert not gets_credentials("http://vllm-0:8000", [])


def test_replica_key_from_the_environment(tmp_path):
    assert replica_key_from_env({}) is None
    assert replica_key_from_env({"KVGATE_REPLICA_API_KEY": "k"}) == "k"
    (tmp_path / "key").write_text("\n# comment\nfile-key\n")
    assert replica_key_from_env({"KVGATE_REPLICA_API_KEY_FILE": str(tmp_path / "key")}) == "file-key"
    for env in (
        {"KVGATE_REPLICA_API_KEY": "k", "KVGATE_REPLICA_API_KEY_FILE": str(tmp_path / "key")},
        {"KVGATE_REPLICA_API_KEY_FILE": str(tmp_path / "missing")},
    ):
        with pytest.raises(ReplicaKeyError):
            replica_key_from_env(env)
    assert allowed(None, None) and allowed("x", None)
    assert allowed("k", "k") and not allowed(None, "k") and not allowed("K", "k")
