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
