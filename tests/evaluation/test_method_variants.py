"""Method variants in `python -m selfspec.eval`: `selfspec:tree=dynamic:tree_nodes=8` times several decode settings of
our engine side by side in one interleaved run (selfspec/evaluation/runner.py: parse_method, method_decode_config)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import make_tiny
from selfspec.data import PromptItem
from selfspec.decoding.config import DecodeConfig, with_tuned_settings
from selfspec.errors import SelfSpecError
from selfspec.evaluation.report import summarize_methods
from selfspec.evaluation.runner import (Renderer, build_methods, check_methods, method_bases, method_decode_config,
                                        parse_method, run_eval)

# The example of eval/README.md, exactly as typed after `python -m selfspec.eval` (one shell word, single-quoted).
README_METHODS = ('methods=[autoregressive,selfspec,"selfspec:tree=static:tree_shape=[2,2,1,1]",'
                  '"selfspec:tree=dynamic:tree_nodes=8","selfspec+lookup:tree=dynamic",lookup,hf_prompt_lookup]')


# ------------------------------------------------------------------------------------------------ parsing
def test_parse_method_reads_yaml_values() -> None:
    spec = parse_method("selfspec:tree=static:tree_shape=[2,2,1,1]:draft_threshold=null:lookup=true:draft_len=3")
    assert spec.name == "selfspec:tree=static:tree_shape=[2,2,1,1]:draft_threshold=null:lookup=true:draft_len=3"
    assert spec.base == "selfspec"
    assert spec.settings == {"tree": "static", "tree_shape": [2, 2, 1, 1], "draft_threshold": None, "lookup": True,
                             "draft_len": 3}
    assert type(spec.settings["draft_len"]) is int
    assert parse_method("selfspec:draft_threshold=0.5").settings == {"draft_threshold": 0.5}
    assert parse_method("selfspec:draft_threshold=1e-3").settings == {"draft_threshold": 0.001}  # YAML 1.1 reads a str
    assert parse_method("selfspec: draft_len = 2").settings == {"draft_len": 2}
    assert parse_method("lookup:lookup_len=5").settings == {"lookup_len": 5}
    assert parse_method("selfspec+lookup").settings == {} and parse_method("hf_generate").base == "hf_generate"
    assert method_bases(["hf_early_exit", "selfspec:draft_len=2", "selfspec+lookup:tree=dynamic"]) == [
        "hf_early_exit", "selfspec", "selfspec+lookup"]


@pytest.mark.parametrize("names, message", [
    (["selfspec:depth=2"], "methods: 'selfspec:depth=2': unknown setting 'depth'; selfspec takes draft_len, "),
    (["selfspec:seed=2"], "unknown setting 'seed'"),
    (["selfspec:draft_len=0"], "methods: 'selfspec:draft_len=0': decode.draft_len=0: must be an integer >= 1"),
    (["selfspec:tree=auto"], "methods: 'selfspec:tree=auto': tree=auto is calibrated once per run, for decode.*"),
    (["selfspec:tree=bushy"], "methods: 'selfspec:tree=bushy': decode.tree='bushy': allowed chain, static, dynamic"),
    (["selfspec:tree_shape=[2,0]"], "methods: 'selfspec:tree_shape=[2,0]': decode.tree_shape=[2, 0]"),
    (["selfspec:lookup=maybe"], "methods: 'selfspec:lookup=maybe': decode.lookup='maybe': must be true or false"),
    (["selfspec:tree_shape=[2,2"], "methods: 'selfspec:tree_shape=[2,2': tree_shape='[2,2' is not a YAML value"),
    (["selfspec:draft_len"], "methods: 'selfspec:draft_len': 'draft_len' is not key=value"),
    (["selfspec:"], "methods: 'selfspec:': '' is not key=value"),
    (["selfspec:draft_len=2:draft_len=3"], "methods: 'selfspec:draft_len=2:draft_len=3': draft_len is given twice"),
    (["autoregressive:draft_len=2"], "methods: 'autoregressive:draft_len=2': autoregressive takes no settings; "
                                     "variants (name:key=value) are for selfspec, lookup, selfspec+lookup"),
    (["hf_prompt_lookup:draft_len=2"], "hf_prompt_lookup takes no settings; variants (name:key=value) are for "
                                       "selfspec, lookup, selfspec+lookup; HF's methods take hf.*"),
    (["lookup:tree=dynamic"], "methods: 'lookup:tree=dynamic': lookup fixes tree=chain; it takes lookup_len, "),
    (["lookup:draft_len=2"], "methods: 'lookup:draft_len=2': unknown setting 'draft_len'; lookup takes lookup_len, "),
    (["selfspec+lookup:lookup=false"], "methods: 'selfspec+lookup:lookup=false': selfspec+lookup fixes lookup=true"),
    (["selfspeck:draft_len=2"], "methods: unknown 'selfspeck:draft_len=2'; allowed hf_generate, "),
    # a variant that sets the threshold on a tree round: DecodeConfig's own message, prefixed with the method
    (["selfspec:tree=dynamic:draft_threshold=0.5"],
     "methods: 'selfspec:tree=dynamic:draft_threshold=0.5': decode.draft_threshold=0.5: not supported with decode.tree"),
    # duplicates after normalisation: key order, the value's spelling, the configured value, the fixed method
    (["selfspec:tree=dynamic:tree_nodes=8", "selfspec:tree_nodes=8:tree=dynamic"],
     "methods: 'selfspec:tree=dynamic:tree_nodes=8' and 'selfspec:tree_nodes=8:tree=dynamic' decode with the same "
     "settings"),
    (["selfspec:draft_len=3", "selfspec:draft_len=03"], "'selfspec:draft_len=3' and 'selfspec:draft_len=03' decode"),
    (["selfspec", "selfspec:draft_len=4"], "'selfspec' and 'selfspec:draft_len=4' decode with the same settings"),
    (["selfspec+lookup", "selfspec:lookup=true"], "'selfspec+lookup' and 'selfspec:lookup=true' decode with the same"),
    (["selfspec", "selfspec"], "each method at most once"),
    (["selfspec:own_precision=int4"], "methods: 'selfspec:own_precision=int4': own_precision='int4': allowed full, int8"),
    (["lookup:own_precision=int8"], "methods: 'lookup:own_precision=int8': unknown setting 'own_precision'"),
])
def test_bad_variants_fail_before_the_model_loads(names, message) -> None:
    # check_methods needs no model: eval calls it right after reading the config
    with pytest.raises(SelfSpecError) as exc:
        check_methods(names, DecodeConfig(draft_len=4))
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_variants_parse_on_the_hydra_command_line() -> None:
    """Hydra's grammar needs each variant quoted (it holds `=`); the README's example composes and checks."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    from selfspec.cli.eval import decode_config_for_eval, eval_config
    from selfspec.utils.paths import conf_dir

    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        cfg = compose("eval", overrides=[README_METHODS])
        ecfg = eval_config(cfg)
        assert ecfg.methods == ["autoregressive", "selfspec", "selfspec:tree=static:tree_shape=[2,2,1,1]",
                                "selfspec:tree=dynamic:tree_nodes=8", "selfspec+lookup:tree=dynamic", "lookup",
                                "hf_prompt_lookup"]
        assert README_METHODS in (Path(__file__).parents[2] / "eval" / "README.md").read_text()  # documented as run
        specs = check_methods(ecfg.methods, decode_config_for_eval(cfg.decode))
        assert specs[2].settings == {"tree": "static", "tree_shape": [2, 2, 1, 1]}
        assert eval_config(compose("eval", overrides=["methods=['selfspec:tree_shape=[2, 2]']"])).methods == [
            "selfspec:tree_shape=[2, 2]"]
        with pytest.raises(HydraException):  # unquoted, `=` ends the element
            compose("eval", overrides=["methods=[selfspec:draft_len=2]"])


# ------------------------------------------------------------------------------------------------ the settings apply
def test_variants_run_side_by_side_losslessly_with_their_own_settings() -> None:
    m = make_tiny("llama", head="lens", exit_layer=2)
    names = ["autoregressive", "selfspec", "selfspec:draft_len=2", "selfspec:tree=dynamic:tree_nodes=4"]
    methods = build_methods(names, m, DecodeConfig(draft_len=4, max_new_tokens=16), head=m.head)
    assert [x.name for x in methods] == names
    assert [x.base for x in methods] == ["autoregressive", "selfspec", "selfspec", "selfspec"]
    assert [(x.cfg.draft_len, x.cfg.tree) for x in methods[1:]] == [(4, "chain"), (2, "chain"), (4, "dynamic")]
    assert methods[3].cfg.tree_nodes == 4 and all(x.decoder.head is m.head for x in methods[1:])
    items = [PromptItem("a", "x", ("one two three one two three",)), PromptItem("b", "y", ("four five", "six"))]
    records = run_eval(methods, items, Renderer(m.tokenizer, chat=False), 16, torch.device("cpu"), warmup=False)
    by = {(r["method"], r["prompt_id"]): r for r in records}
    assert {r["method"] for r in records} == set(names)  # the record's method is the variant string as given
    for name in names[1:]:
        for pid in ("a", "b"):
            assert by[(name, pid)]["token_ids"] == by[("autoregressive", pid)]["token_ids"], (name, pid)
    drafted = {name: sum(by[(name, p)]["stats"]["drafted"] for p in "ab") for name in names}
    assert drafted["autoregressive"] == 0 and len(set(drafted.values())) == len(names), drafted
    per_position = {name: len(by[(name, "a")]["stats"]["drafted_per_position"]) for name in names[1:]}
    assert per_position == {"selfspec": 4, "selfspec:draft_len=2": 2, "selfspec:tree=dynamic:tree_nodes=4": 4}
    summary = summarize_methods(records, reference="autoregressive")
    assert list(summary["methods"]) == names
    assert all(s["lossless"] == 1.0 and s["sampled"] is False for s in summary["methods"].values())


def test_a_context_heads_own_precision_is_a_variant() -> None:
    """`selfspec:own_precision=int8` drafts with the same context head's matrices in int8, beside the float ones, in
    one run, both lossless; asked of a head type without the setting it is one clear error."""
    from conftest import randomize_head

    m = make_tiny("llama")
    m.set_head("context", exit_layer=2)
    randomize_head(m.head, seed=1, std=0.05)
    names = ["autoregressive", "selfspec", "selfspec:own_precision=int8"]
    methods = build_methods(names, m, DecodeConfig(draft_len=2, max_new_tokens=16), head=m.head)
    own, base = methods[2].decoder.head, methods[1].decoder.head
    assert base is m.head and own is not m.head and own.layers is m.head.layers  # the same weights
    assert (base.config.own_precision, own.config.own_precision) == ("full", "int8")
    items = [PromptItem("a", "x", ("one two three one two three",))]
    records = run_eval(methods, items, Renderer(m.tokenizer, chat=False), 16, torch.device("cpu"), warmup=False)
    by = {r["method"]: r for r in records}
    assert by[names[1]]["token_ids"] == by[names[2]]["token_ids"] == by["autoregressive"]["token_ids"]
    assert by[names[2]]["stats"]["drafted"] > 0
    lens = make_tiny("llama", head="lens", exit_layer=2)
    with pytest.raises(SelfSpecError, match="own_precision is a context head's setting; this method drafts with a lens head"):
        build_methods(["selfspec:own_precision=int8"], lens, DecodeConfig(draft_len=2), head=lens.head)


# ------------------------------------------------------------------------------------------------ dynamic K
def test_tree_and_lookup_methods_run_without_the_threshold_unless_they_set_it() -> None:
    """A head tuned with draft_threshold=0.6 (the eval path: with_tuned_settings, then build_methods): the chain
    methods keep dynamic K, every tree or lookup method drops it, a variant's own threshold stays."""
    m = make_tiny("llama", head="lens", exit_layer=2)
    decode, taken = with_tuned_settings(DecodeConfig(draft_len=4, max_new_tokens=12),
                                        {"draft_len": 3, "draft_threshold": 0.6}, user_set=set())
    assert taken == ["draft_len", "draft_threshold"] and decode.draft_threshold == 0.6
    names = ["autoregressive", "selfspec", "selfspec+lookup", "lookup", "selfspec:tree=dynamic:tree_nodes=4",
             "selfspec:lookup=true:tree=static", "selfspec:draft_threshold=0.3", "selfspec:draft_threshold=null"]
    check_methods(names, decode)
    methods = build_methods(names, m, decode, head=m.head)
    thresholds = {x.name: x.cfg.draft_threshold for x in methods}
    assert thresholds == {"autoregressive": 0.6, "selfspec": 0.6, "selfspec+lookup": None, "lookup": None,
                          "selfspec:tree=dynamic:tree_nodes=4": None, "selfspec:lookup=true:tree=static": None,
                          "selfspec:draft_threshold=0.3": 0.3, "selfspec:draft_threshold=null": None}
    ids = m.encode("hello there hello there hello", chat=False)
    ref, _ = methods[0].generate(ids, 12)
    for method in methods[1:]:
        new, stats = method.generate(ids, 12)
        assert new == ref, method.name
    # the rule is the method's, not the spelling's: method_decode_config alone gives the same
    assert method_decode_config(parse_method("selfspec+lookup"), decode).draft_threshold is None
    assert method_decode_config(parse_method("hf_generate"), decode) is None
    with pytest.raises(SelfSpecError, match="^methods: 'selfspec\\+lookup:draft_threshold=0.6': decode.draft_threshold"):
        check_methods(["selfspec+lookup:draft_threshold=0.6"], decode)


# ------------------------------------------------------------------------------------------------ a method's own head
def _saved_heads(tmp_path: Path):
    """A tiny llama with a lens head, and two saved medusa heads of different weights for it."""
    from conftest import randomize_head
    from selfspec.heads import HeadConfig, build_head, save_head

    m = make_tiny("llama", head="lens", exit_layer=2, initializer_range=0.3)
    dirs = []
    for seed in (1, 2):
        h = build_head(HeadConfig(type="medusa", exit_layer=2), m.backbone, m.eos_ids)
        randomize_head(h, seed=seed, std=0.3)
        dirs.append(str(save_head(h, tmp_path / f"medusa-{seed}", m.backbone, extra={"decode": {"draft_len": 2}})))
    return m, dirs


def test_a_variant_names_its_own_head(tmp_path: Path) -> None:
    from selfspec.evaluation.runner import method_head_refs, needs_run_head

    a = str(tmp_path)
    (tmp_path / "head_config.json").write_text("{}")  # parsing checks the file is there; loading reads it
    assert parse_method(f"selfspec:head={a}:draft_len=2").settings == {"head": a, "draft_len": 2}
    assert parse_method("selfspec+lookup:head=default").settings == {"head": "default"}
    names = ["autoregressive", f"selfspec:head={a}", f"selfspec:head={a}:draft_len=2", "selfspec:head=default"]
    assert method_head_refs(names) == [a, "default"]
    assert not needs_run_head(names) and needs_run_head([*names, "selfspec+lookup"])
    assert not needs_run_head(["autoregressive", "lookup", "hf_early_exit"])
    # the same decode settings with two heads are two methods; with the same head twice, one
    assert len(check_methods(["selfspec", f"selfspec:head={a}"], DecodeConfig())) == 2
    with pytest.raises(SelfSpecError, match="decode with the same settings"):
        check_methods([f"selfspec:head={a}", f"selfspec:head={a}:draft_len=4"], DecodeConfig(draft_len=4))


@pytest.mark.parametrize("name, message", [
    ("selfspec:head=/no/such/dir", "methods: 'selfspec:head=/no/such/dir': head='/no/such/dir': give a saved head "
                                   "directory (one with head_config.json; no ':' in the path), a shipped head ("),
    ("selfspec:head=/tmp", "head='/tmp': give a saved head directory (one with head_config.json"),
    ("selfspec:head=", "head=None: give a saved head directory"),
    ("selfspec:head=[1,2]", "head=[1, 2]: give a saved head directory"),
    ("lookup:head=default", "methods: 'lookup:head=default': unknown setting 'head'; lookup takes"),
])
def test_a_bad_method_head_is_one_clear_error(name, message) -> None:
    with pytest.raises(SelfSpecError) as exc:
        check_methods([name], DecodeConfig())
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_heads_compare_in_one_interleaved_run_losslessly(tmp_path: Path) -> None:
    """Two saved heads and the run's lens drafting in one run: each method drafts with its own head (and precision),
    every output equals the autoregressive one, and the drafts differ between heads."""
    from selfspec.cli.eval import _method_heads, _run_markdown
    from selfspec.evaluation.config import EvalConfig

    m, (a, b) = _saved_heads(tmp_path)
    names = ["autoregressive", "selfspec", f"selfspec:head={a}", f"selfspec:head={b}",
             f"selfspec:head={b}:draft_precision=int8"]
    decode = DecodeConfig(draft_len=3, max_new_tokens=16)
    loaded, info = _method_heads(EvalConfig(methods=names), m, decode)
    assert list(loaded) == [a, b] and set(info) == set(names[2:])
    assert info[names[3]]["type"] == "medusa" and info[names[3]]["source"] == "path" and info[names[3]]["path"] == b
    methods = build_methods(names, m, decode, head=m.head, method_heads=loaded)
    heads = [x.decoder.head for x in methods[1:]]
    assert heads[0] is m.head and heads[1] is loaded[a] and heads[2] is loaded[b]
    assert heads[3] is not loaded[b] and heads[3].draft_precision == "int8" and loaded[b].draft_precision == "full"
    assert all(x.cfg.draft_len == 3 for x in methods[1:])  # the run's decode.*, not the saved heads' draft_len=2
    items = [PromptItem("a", "x", ("one two three one two three",)), PromptItem("b", "y", ("four five six",))]
    records = run_eval(methods, items, Renderer(m.tokenizer, chat=False), 16, torch.device("cpu"), warmup=False)
    by = {(r["method"], r["prompt_id"]): r for r in records}
    for name in names[1:]:
        for pid in "ab":
            assert by[(name, pid)]["token_ids"] == by[("autoregressive", pid)]["token_ids"], (name, pid)
    accepted = {n: tuple(by[(n, p)]["stats"]["accepted"] for p in "ab") for n in names[1:4]}
    assert len(set(accepted.values())) > 1, accepted  # three heads do not all draft alike
    assert by[(names[2], "a")]["head_params"] == loaded[a].num_params() != by[("selfspec", "a")]["head_params"]
    assert f"- `{names[2]}`: its own head `medusa` at E=2 ({a}," in _run_markdown(
        {"method_heads": info, "prompts": 2, "max_new_tokens": 16, "device": "cpu", "dtype": "float32"}, 1.0)
    with pytest.raises(SelfSpecError, match="was not loaded"):
        build_methods(names, m, decode, head=m.head)
