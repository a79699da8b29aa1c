import argparse

import pytest

from server.config import ServeConfig, add_arguments, from_args, parse_bytes


def parse(argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return from_args(p.parse_args(argv))


def test_sizes():
    assert parse_bytes("2GiB") == 2 * 2**30 and parse_bytes("512MB") == 512 * 10**6 and parse_bytes(7) == 7
    with pytest.raises(ValueError):
        parse_bytes("lots")


def test_flags_override_yaml(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("port: 9000\nkv-cache-bytes: 1GiB\nmax_num_seqs: 4\nprefix-caching: false\n")
    cfg = parse(["--config", str(f), "--port", "9100"])
    assert (cfg.port, cfg.kv_cache_bytes, cfg.max_num_seqs, cfg.prefix_caching) == (9100, 2**30, 4, False)
    assert cfg.kv_capacity_bytes() == 2**30
    assert parse(["--config", str(f), "--prefix-caching", "on"]).prefix_caching and parse([]).prefix_caching


@pytest.mark.parametrize("argv,message", [(["--prefix-caching", "maybe"], "cannot read 'maybe' as on or off"),
                                          (["--kv-cache-bytes", "lots"], "cannot read 'lots' as a size")])
def test_bad_flag_values_say_why(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse(argv)
    assert f"argument {argv[0]}: {message}" in capsys.readouterr().err


def test_bad_values_are_refused_with_a_message(tmp_path):
    with pytest.raises(ValueError, match="needs kv_format oaken"):
        ServeConfig(attention="magicpig")
    with pytest.raises(ValueError, match="lsh_dense_layers"):
        ServeConfig(kv_format="oaken", attention="magicpig", lsh_dense_layers="0;15")
    assert ServeConfig(kv_format="oaken", attention="magicpig", lsh_dense_layers="0, 15").lsh_config().dense_layers == (0, 15)
    assert ServeConfig().lsh_config() is None
    with pytest.raises(ValueError, match="kv_format"):
        ServeConfig(kv_format="int3")
    with pytest.raises(ValueError, match="cpu_linear_dtype"):
        ServeConfig(cpu_linear_dtype="float16")
    f = tmp_path / "c.yaml"
    f.write_text("colour: blue\n")
    with pytest.raises(ValueError, match="unknown option"):
        ServeConfig.from_file(f)


def test_every_option_is_documented_in_help(capsys):
    from hetserve.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    import dataclasses

    for f in dataclasses.fields(ServeConfig):
        assert "--" + f.name.replace("_", "-") in out


def test_magicpig_defaults_agree_with_lsh_config():
    """serve's options and eval's repeat LshConfig's defaults (parsing options does not import torch)."""
    from cpu_attn.magicpig import LshConfig
    from evaluation.cli import add_eval_arguments

    default = LshConfig()
    assert parse(["--kv-format", "oaken", "--attention", "magicpig"]).lsh_config() == default
    p = argparse.ArgumentParser()
    add_eval_arguments(p)
    ev = p.parse_args([])
    assert (ev.lsh_k, ev.lsh_l, ev.lsh_min_collisions, ev.lsh_sinks, ev.lsh_window, ev.lsh_min_context,
            ev.lsh_retrieval, ev.lsh_recenter) == (default.k, default.l, default.min_collisions, default.sinks,
                                                   default.window, default.min_context, default.retrieval,
                                                   default.recenter)
    off = parse(["--kv-format", "oaken", "--attention", "magicpig", "--lsh-recenter", "off"]).lsh_config()
    assert off.recenter is False and p.parse_args(["--lsh-recenter", "off"]).lsh_recenter is False


@pytest.mark.parametrize("command", ["serve", "eval", "calibrate"])
def test_a_missing_model_is_an_error_message_not_a_traceback(command, tmp_path, capsys):
    from hetserve.cli import main

    with pytest.raises(SystemExit) as exc:
        main([command, "--model", str(tmp_path / "none.gguf")])
    assert exc.value.code == 1
    assert capsys.readouterr().err == f"hetserve {command}: error: model path {tmp_path / 'none.gguf'} does not exist\n"


def test_too_small_a_cache_for_magicpig_is_an_error_message_not_a_traceback(capsys):
    """MagicPIG's tables count in the KV capacity: a block of 16 tokens takes ~0.9 MiB with them at
    SmolLM2's shape, and `hetserve serve` says what to change."""
    from hetserve.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", "--kv-format", "oaken", "--attention", "magicpig", "--kv-cache-bytes", "1MiB"])
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert "error: KV capacity 1.0 MiB has room for 0 blocks beside the" in err
    assert "too few for a sequence of 1024 tokens with its MagicPIG tables (128 blocks of 949056 B)" in err
    assert "raise --kv-cache-bytes" in err and "Traceback" not in err
