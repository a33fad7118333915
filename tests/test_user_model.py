"""A user's own Hugging Face model directory through the three stages (issue: the README's promises
outside the embedded default): its tokenizer follows it, mismatches are errors, LoRA adapters
chain SFT -> reward -> PPO, and exported directories behave the same under plain transformers.

The user model is an OPT (not the default's Llama) with a byte-pair tokenizer built here whose ids,
merges and special tokens differ from the shipped character tokenizer's.
"""
from __future__ import annotations

import json
import os
import string

import pytest
import torch

from conftest import ROOT, run_stage, summary

PAIRS_EVAL = str(ROOT / "data/default/pairs_eval.jsonl")
EVAL_PROMPTS = 40
SPECIALS = ["<|bos|>", "<|eot|>", "<|pad|>"]  # the shipped tokenizer has <s>, </s>, <pad>, <unk>


def make_user_tokenizer():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = list(string.printable[:95]) + ["\n"]  # digits, letters, punctuation, space, newline
    merged = ["Hu", "Hum", "an", "As", "nt", "ss"]
    vocab = {t: i for i, t in enumerate(list(reversed(chars)) + merged + SPECIALS)}
    merges = [("H", "u"), ("Hu", "m"), ("a", "n"), ("A", "s"), ("n", "t"), ("s", "s")]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|bos|>", eos_token="<|eot|>", pad_token="<|pad|>")
    tok.chat_template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    return tok


def user_model_dir(root):
    """<root>/opt-user: a local OPT directory with its own tokenizer, as a user would bring (random weights)."""
    from transformers import AutoModelForCausalLM, OPTConfig

    tok = make_user_tokenizer()
    cfg = OPTConfig(vocab_size=len(tok), hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                    word_embed_proj_dim=32, max_position_embeddings=128, bos_token_id=tok.bos_token_id,
                    eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    path = root / "opt-user"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def user_model(tmp_path_factory):
    return user_model_dir(tmp_path_factory.mktemp("user"))


def vocab(path) -> dict[str, int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path).get_vocab()


SFT = ["train.max_steps=4", "train.save_every=0", "train.eval_every=0", "data.num_eval_prompts=8",
       "train.micro_batch_size=8", "train.global_batch_size=8", "train.lr=1e-2", "eval.max_new_tokens=6"]
RM = ["train.max_steps=4", "train.save_every=0", "train.eval_every=0", "train.micro_batch_size=8",
      "train.global_batch_size=8", "train.lr=1e-2", "model.fallback_to_config=false"]
PPO = ["train.max_steps=1", "train.eval_every=0", "data.num_eval_prompts=8", "rollout.prompts_per_step=8",
       "rollout.mini_batch_size=8", "rollout.micro_batch_size=8", "rollout.max_new_tokens=6", "eval.max_new_tokens=6"]
LORA = ["model.lora.r=4", "model.lora.alpha=8", "model.lora.merge_on_save=false"]


# ----------------------------------------------------------------------------- the tokenizer follows the model


def test_a_model_path_brings_its_own_tokenizer_through_all_three_stages(user_model, tmp_path):
    user_vocab = vocab(user_model)
    assert user_vocab != vocab(ROOT / "data/tokenizer")
    sft, rm, ppo = tmp_path / "sft", tmp_path / "rm", tmp_path / "ppo"
    run_stage("sft", f"output_dir={sft}", f"model.name_or_path={user_model}", *SFT)
    run_stage("reward", f"output_dir={rm}", f"model.name_or_path={sft}", *RM)
    run_stage("ppo", f"output_dir={ppo}", f"actor.model={sft}", f"critic.model={rm}", *PPO)
    for out in (sft / "model", rm / "model", ppo / "model", ppo / "critic"):
        assert vocab(out) == user_vocab, out
    with open(sft / "config.yaml") as f:
        assert "tokenizer: null" in f.read()  # resolved: the model's own, not the tiny preset's
    assert json.load(open(sft / "model" / "config.json"))["model_type"] == "opt"


def test_cfg_job_shows_which_tokenizer_a_run_uses(user_model):
    shipped = run_stage("sft", "--cfg", "job").stdout
    assert f"tokenizer: {ROOT / 'data/tokenizer'}" in shipped
    assert "tokenizer: null" in run_stage("sft", f"model.name_or_path={user_model}", "--cfg", "job").stdout


def test_a_tokenizer_that_does_not_fit_the_model_is_an_error(user_model, tmp_path):
    proc = run_stage("sft", f"output_dir={tmp_path}", f"model.name_or_path={user_model}",
                     f"model.tokenizer={ROOT / 'data/tokenizer'}", *SFT, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert "model: the tokenizer's bos token is '<s>'" in proc.stderr and "bos_token_id=" in proc.stderr


def test_vocabulary_larger_than_the_embedding_is_an_error(user_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf.config import ConfigError
    from rlhf.modeling.load import check_tokenizer_fits

    model = AutoModelForCausalLM.from_pretrained(user_model)
    tok = AutoTokenizer.from_pretrained(user_model)
    check_tokenizer_fits(model, tok, "model")  # its own tokenizer fits
    tok.add_tokens(["<|new|>"])
    with pytest.raises(ConfigError, match=rf"has {len(tok)} tokens but the model's embedding has only {len(tok) - 1} rows"):
        check_tokenizer_fits(model, tok, "model")


def test_ppo_models_saved_with_another_tokenizer_are_an_error(user_model, tmp_path):
    """The four PPO models must share one tokenizer: a critic directory whose tokenizer is not the
    actor's stops the run before any model loads, naming the key (embedding sizes alone would not)."""
    import shutil

    from transformers import AutoTokenizer

    from rlhf.modeling.load import tokenizer_mismatch

    shipped = AutoTokenizer.from_pretrained(ROOT / "data/tokenizer")
    mine = AutoTokenizer.from_pretrained(user_model)
    assert tokenizer_mismatch(mine, AutoTokenizer.from_pretrained(user_model)) is None
    assert "vocabularies differ" in tokenizer_mismatch(mine, shipped)
    other = tmp_path / "critic"
    shutil.copytree(user_model, other)
    for f in other.glob("tokenizer*"):
        f.unlink()
    shipped.save_pretrained(other)
    # (the judge as the reward: a causal LM may start a critic, but as the reward model it is refused first)
    proc = run_stage("ppo", f"output_dir={tmp_path / 'ppo'}", f"actor.model={user_model}", f"critic.model={other}",
                     *PPO, "reward.sources=[judge]", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "critic.model=" in proc.stderr and "another tokenizer than actor.model" in proc.stderr


# ----------------------------------------------------------------------------- presets: keys of the family


@pytest.mark.parametrize("key,hint", [("intermediate_size", None), ("ffn_dimm", "ffn_dim")])
def test_opt_preset_rejects_keys_opt_does_not_have(key, hint, tmp_path):
    proc = run_stage("sft", f"output_dir={tmp_path}", "model=opt", "model.name_or_path=null",
                     f"model.tokenizer={ROOT / 'data/tokenizer'}", "+model.config.model_type=opt",
                     f"+model.config.{key}=64", *SFT, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"model.config.{key}: OPTConfig (model_type 'opt') has no key '{key}'" in proc.stderr
    if hint:
        assert f"did you mean {hint}" in proc.stderr


def test_the_family_s_own_keys_are_used():
    from transformers import AutoTokenizer

    from rlhf.config import ModelConfig
    from rlhf.modeling.load import load_causal_lm

    tok = AutoTokenizer.from_pretrained(ROOT / "data/tokenizer")
    cfg = ModelConfig(config={"model_type": "opt", "hidden_size": 32, "ffn_dim": 48, "num_hidden_layers": 1,
                              "num_attention_heads": 2, "word_embed_proj_dim": 32})
    model = load_causal_lm(cfg, tok, seed=0)
    assert model.config.ffn_dim == 48 and model.model.decoder.layers[0].fc1.out_features == 48


# ----------------------------------------------------------------------------- LoRA across the stages


def _logits(model, ids):
    with torch.no_grad():
        out = model.eval()(input_ids=ids)
    return out.logits


@pytest.fixture(scope="module")
def adapter_chain(user_model, tmp_path_factory):
    """SFT -> reward -> PPO, every stage training LoRA and saving only its adapter."""
    root = tmp_path_factory.mktemp("chain")
    sft, rm, ppo = root / "sft", root / "rm", root / "ppo"
    run_stage("sft", f"output_dir={sft}", f"model.name_or_path={user_model}", *SFT, *LORA)
    run_stage("reward", f"output_dir={rm}", f"model.name_or_path={sft}", *RM, *LORA)
    run_stage("ppo", f"output_dir={ppo}", f"actor.model={sft}", f"critic.model={rm}", *PPO, *LORA,
              "actor.lr=1e-2", "critic.lr=1e-2")
    return user_model, sft, rm, ppo


def test_adapter_chain_saves_adapters_naming_their_real_base(adapter_chain):
    user_model, sft, rm, ppo = adapter_chain
    base_of = {d: json.load(open(d / "adapter_config.json"))["base_model_name_or_path"]
               for d in (sft / "model", rm / "model", ppo / "model", ppo / "critic")}
    assert base_of[sft / "model"] == str(user_model)
    assert base_of[rm / "model"] == str(sft / "model")  # the reward adapter sits on the SFT adapter
    assert base_of[ppo / "model"] == str(sft / "model")
    assert base_of[ppo / "critic"] == str(rm / "model")
    for d in base_of:
        assert not os.path.exists(d / "model.safetensors")


def test_each_stage_loads_exactly_what_the_previous_one_saved(adapter_chain):
    """Our loader on an adapter chain = plain transformers + peft applying the same adapters by hand."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from rlhf.config import ModelConfig
    from rlhf.modeling.load import load_causal_lm, load_tokenizer, load_value_model

    user_model, sft, rm, ppo = adapter_chain
    tok = AutoTokenizer.from_pretrained(sft / "model")
    ids = torch.tensor([tok("Human: Reverse abc.\n\nAssistant: cba")["input_ids"]])

    def by_hand(cls, *adapters):
        m = cls.from_pretrained(user_model, **({"num_labels": 1} if cls is AutoModelForSequenceClassification else {}))
        for a in adapters:
            m = PeftModel.from_pretrained(m, a).merge_and_unload()
        return m

    ours_sft = load_causal_lm(ModelConfig(name_or_path=str(sft)), load_tokenizer(ModelConfig(name_or_path=str(sft))), seed=0)
    ref_sft = by_hand(AutoModelForCausalLM, sft / "model")
    torch.testing.assert_close(_logits(ours_sft, ids), _logits(ref_sft, ids), rtol=0, atol=0)
    assert not torch.allclose(_logits(ref_sft, ids), _logits(AutoModelForCausalLM.from_pretrained(user_model), ids))

    ours_ppo = load_causal_lm(ModelConfig(name_or_path=str(ppo)), tok, seed=0)
    ref_ppo = by_hand(AutoModelForCausalLM, sft / "model", ppo / "model")
    torch.testing.assert_close(_logits(ours_ppo, ids), _logits(ref_ppo, ids), rtol=0, atol=0)
    assert not torch.allclose(_logits(ours_ppo, ids), _logits(ref_sft, ids))  # PPO's adapter is not lost

    # the reward model: the SFT adapter merged into the backbone, then the reward adapter (+ its head)
    ours_rm = load_value_model(ModelConfig(name_or_path=str(rm)), tok, seed=0).eval()
    backbone = by_hand(AutoModelForCausalLM, sft / "model").model
    ref_rm = AutoModelForSequenceClassification.from_pretrained(user_model, num_labels=1)
    ref_rm.model.load_state_dict(backbone.state_dict())
    ref_rm = PeftModel.from_pretrained(ref_rm, rm / "model").merge_and_unload().eval()
    with torch.no_grad():
        torch.testing.assert_close(ours_rm(input_ids=ids).logits, ref_rm(input_ids=ids).logits, rtol=0, atol=0)


def test_stages_train_from_an_adapter_without_new_lora(adapter_chain, tmp_path):
    """Loading an adapter merges it into weights that train (no frozen base left behind)."""
    _, sft, rm, _ = adapter_chain
    run_stage("sft", f"output_dir={tmp_path / 'sft2'}", f"model.name_or_path={sft}", *SFT)
    run_stage("ppo", f"output_dir={tmp_path / 'ppo2'}", f"actor.model={sft}", f"critic.model={rm}", *PPO)
    assert summary(tmp_path / "sft2")["steps"] == 4 and summary(tmp_path / "ppo2")["stage"] == "ppo"


# ----------------------------------------------------------------------------- plain transformers = the run


@pytest.fixture(scope="module")
def default_outputs(tmp_path_factory):
    """A short SFT + reward run on the embedded default (shipped tokenizer), as the README's user does."""
    root = tmp_path_factory.mktemp("plain")
    sft, rm = root / "sft", root / "rm"
    # A few steps from scratch score 0 on the task; memorising half of the eval prompts' answers
    # makes the gold score non-trivial, so that "equal" below is not 0 == 0.
    rows = [json.loads(line) for line in open(ROOT / "data/default/eval_prompts.jsonl")][:EVAL_PROMPTS // 2]
    with open(root / "memorise.jsonl", "w") as f:
        for r in rows * 16:
            f.write(json.dumps({"prompt": r["prompt"], "response": " " + r["answer"]}) + "\n")
    run_stage("sft", f"output_dir={sft}", f"data.path={root / 'memorise.jsonl'}", "data.eval_fraction=0",
              "train.max_steps=80", "train.save_every=0", "train.eval_every=0", "train.lr=3e-3",
              "train.warmup_steps=5", f"data.num_eval_prompts={EVAL_PROMPTS}",
              f"data.eval_prompts_path={ROOT / 'data/default/eval_prompts.jsonl'}")  # own data.path: named
    # fp32: scores are compared with plain transformers in fp32 (under the default, auto = bf16 on a
    # bf16-capable CPU, the run scores in bf16 and a pair or two of 400 can flip: 0.575 vs 0.5825)
    run_stage("reward", f"output_dir={rm}", f"model.name_or_path={sft}", "train.max_steps=40", "train.save_every=0",
              "train.eval_every=0", "model.fallback_to_config=false", "engine.precision=fp32")
    return sft, rm


def test_exported_tokenizers_encode_as_training(default_outputs):
    from transformers import AutoTokenizer

    sft, rm = default_outputs
    shipped = AutoTokenizer.from_pretrained(ROOT / "data/tokenizer")
    text = "Human: Sort 3 1 2.\n\nAssistant: 1 2 3"
    body = shipped(text, add_special_tokens=False)["input_ids"]
    assert AutoTokenizer.from_pretrained(sft / "model")(text)["input_ids"] == [shipped.bos_token_id] + body
    assert AutoTokenizer.from_pretrained(rm / "model")(text)["input_ids"] == [shipped.bos_token_id] + body + [
        shipped.eos_token_id]


def test_plain_transformers_reward_scores_give_the_run_s_accuracy(default_outputs):
    """docs/own-model.md's snippet: AutoModelForSequenceClassification + tokenizer(prompt + response)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    _, rm = default_outputs
    tok = AutoTokenizer.from_pretrained(rm / "model")
    model = AutoModelForSequenceClassification.from_pretrained(rm / "model").eval()
    rows = [json.loads(line) for line in open(PAIRS_EVAL)]

    def scores(texts):
        batch = tok(texts, return_tensors="pt", padding=True)
        with torch.no_grad():
            return model(**batch).logits[:, 0]

    wins = 0
    for i in range(0, len(rows), 50):
        chunk = rows[i : i + 50]
        wins += int((scores([r["prompt"] + r["chosen"] for r in chunk]) > scores([r["prompt"] + r["rejected"] for r in chunk])).sum())
    assert wins / len(rows) == pytest.approx(summary(rm)["eval_accuracy"], abs=1e-6)  # stored as float32


def test_plain_transformers_generation_gives_the_run_s_gold_score(default_outputs):
    """docs/own-model.md's snippet: tokenizer(prompts) -> generate (greedy) -> decode, scored by the judge."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf.core.task import judge

    sft, _ = default_outputs
    tok = AutoTokenizer.from_pretrained(sft / "model", padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(sft / "model").eval()
    rows = [json.loads(line) for line in open(ROOT / "data/default/eval_prompts.jsonl")][:EVAL_PROMPTS]
    batch = tok([r["prompt"] for r in rows], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id)
    texts = tok.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    gold = 100.0 * sum(judge(r["prompt"], t, r.get("answer")) for r, t in zip(rows, texts)) / len(rows)
    assert gold == pytest.approx(summary(sft)["gold_score_after"], abs=1e-9)
    assert gold > 0  # a trained model, so the equality is not 0 == 0


# ----------------------------------------------------------------------------- docs/own-model.md's section, run


def readme_own_model_blocks() -> tuple[list[str], str]:
    """The bash commands and the Python snippet of docs/own-model.md's "Your own model" section."""
    text = (ROOT / "docs/own-model.md").read_text()
    section = text[text.index("<!-- docs-own-model"):text.index("## Data formats")]
    bash = section[section.index("```bash") + 7:]
    bash = bash[:bash.index("```")]
    commands = [line for line in bash.splitlines() if line.startswith("python -m ")]
    py = section[section.index("```python") + 9:]
    return commands, py[:py.index("```")]


SMOKE = {"sft": SFT, "reward": RM, "ppo": [*PPO, "actor.lr=1e-2", "critic.lr=1e-2"],
         "evaluate": ["data.num_eval_prompts=8", "eval.max_new_tokens=6", "batch_size=8"]}


def test_readme_own_model_commands_run(user_model, tmp_path):
    commands, snippet = readme_own_model_blocks()
    assert len(commands) == 7 and snippet
    rows = [json.loads(line) for line in open(ROOT / "data/default/sft_train.jsonl")][:64]
    with open(tmp_path / "my_sft.jsonl", "w") as f:  # message lists: rendered with the model's chat template
        for r in rows:
            f.write(json.dumps({"messages": [{"role": "user", "content": r["prompt"]},
                                             {"role": "assistant", "content": r["response"]}]}) + "\n")
    subst = {"/models/my-model": str(user_model), "my_sft.jsonl": str(tmp_path / "my_sft.jsonl"),
             "my_pairs.jsonl": str(ROOT / "data/default/pairs_train.jsonl"), "runs/": f"{tmp_path}/runs/"}
    for command in commands:
        for a, b in subst.items():
            command = command.replace(a, b)
        module = command.split()[2].removeprefix("rlhf.")
        run_stage(module, *command.split()[3:], *SMOKE[module])
    runs = tmp_path / "runs"
    assert summary(runs / "sft")["steps"] == 4 and vocab(runs / "sft" / "model") == vocab(user_model)
    assert summary(runs / "rm")["stage"] == "reward"
    assert summary(runs / "ppo_lora")["stage"] == "ppo"
    assert json.load(open(runs / "ppo_lora" / "model" / "adapter_config.json"))["base_model_name_or_path"] == str(
        runs / "sft_lora" / "model")
    assert summary(runs / "eval_rm")["eval_accuracy"] is not None  # mode auto: a reward adapter chain
    assert summary(runs / "eval_ppo")["gold_score"] is not None
    # the Python snippet, on the merged outputs: it prints generations and scores
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(snippet.replace('"runs/', f'"{tmp_path}/runs/'), {})
    printed = buf.getvalue().splitlines()
    assert printed[0].startswith("[") and printed[1].startswith("tensor(")


# ----------------------------------------------------------------------------- issue #29: a model in the wrong place


def test_a_reward_model_is_refused_where_a_causal_lm_is_needed(user_model, tmp_path):
    """A *ForSequenceClassification directory (a reward stage's output) as the policy used to load as a causal
    LM with a random LM head and train (#29): refused from its config.json / adapter_config.json, before any
    weights load, naming the key; a model file instead of its directory is refused at validation."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhf.config import ConfigError, ModelConfig
    from rlhf.config.validate import validate_model
    from rlhf.modeling.load import check_causal_lm, load_causal_lm, value_model_reason

    rm = tmp_path / "rm"
    AutoModelForSequenceClassification.from_pretrained(user_model, num_labels=1).save_pretrained(rm)
    AutoTokenizer.from_pretrained(user_model).save_pretrained(rm)
    (tmp_path / "stage" / "model").parent.mkdir()
    os.symlink(rm, tmp_path / "stage" / "model")  # a stage's output_dir holding it
    assert value_model_reason(str(user_model)) is None
    assert "architectures ['OPTForSequenceClassification']" in value_model_reason(str(rm))
    assert value_model_reason(str(tmp_path / "stage")) and value_model_reason("facebook/opt-125m") is None
    with pytest.raises(ConfigError, match=r"^actor.model='.*rm' is a reward / value model \(.*config.json has "
                                          r"architectures \['OPTForSequenceClassification'\]\), not a causal LM"):
        check_causal_lm(str(rm), "actor")
    (rm / "model.safetensors").unlink()  # no weights were needed to tell
    for key, named in (("model", "model.name_or_path="), ("reference", "reference.model=")):
        with pytest.raises(ConfigError, match=named):
            load_causal_lm(ModelConfig(name_or_path=str(rm)), AutoTokenizer.from_pretrained(rm), seed=0, key=key)
    # a file where a model directory belongs: a clear message, not a hub repo-id error
    with pytest.raises(ConfigError, match=r"model.name_or_path='.*config.json' is a file: it must be a model "
                                          "directory"):
        validate_model(ModelConfig(name_or_path=str(user_model / "config.json")))


def test_a_moved_adapter_chain_loads_and_a_missing_base_is_named(tmp_path):
    """An adapter-only output (model.lora.merge_on_save=false) records its base by absolute path in
    adapter_config.json (plain peft reads it) and relative to itself in adapter_base.json (read first): a runs
    folder moved whole still loads; a copy elsewhere falls back to the absolute path; a base that is gone is a
    ConfigError naming adapter_config.json and the path it records (#29)."""
    import shutil

    from rlhf.config import ConfigError, ModelConfig
    from rlhf.modeling.load import adapter_chain, load_causal_lm, load_tokenizer

    runs = tmp_path / "runs"
    base = user_model_dir(runs)
    run_stage("sft", f"output_dir={runs / 'sft'}", f"model.name_or_path={base}", *LORA, "train.max_steps=1",
              *SFT[1:])
    adapter = runs / "sft" / "model"
    assert json.load(open(adapter / "adapter_config.json"))["base_model_name_or_path"] == str(base)  # for peft
    assert json.load(open(adapter / "adapter_base.json"))["relative_path"] == "../../opt-user"
    ids = torch.tensor([[5, 6, 7, 8]])
    want = _logits(load_causal_lm(ModelConfig(name_or_path=str(runs / "sft")), load_tokenizer(
        ModelConfig(name_or_path=str(runs / "sft"))), seed=0), ids)

    def logits(path):
        cfg = ModelConfig(name_or_path=str(path))
        return _logits(load_causal_lm(cfg, load_tokenizer(cfg), seed=0), ids)

    moved = tmp_path / "moved"
    shutil.move(runs, moved)  # the whole runs folder: the absolute path is gone, the relative one holds
    assert adapter_chain(str(moved / "sft" / "model")) == (str(moved / "opt-user"), [str(moved / "sft" / "model")])
    torch.testing.assert_close(logits(moved / "sft"), want, rtol=0, atol=0)
    copy = tmp_path / "elsewhere" / "deep"
    shutil.copytree(moved / "sft", copy)  # the copy's relative path finds nothing: adapter_config.json's is used
    base.parent.mkdir()
    shutil.move(moved / "opt-user", base)  # the base back where adapter_config.json says
    torch.testing.assert_close(logits(copy), want, rtol=0, atol=0)
    shutil.rmtree(base)
    with pytest.raises(ConfigError) as e:
        logits(copy)
    assert str(e.value).startswith(f"{copy / 'model' / 'adapter_config.json'} records base_model_name_or_path="
                                   f"'{base}', which does not exist (nor '../../opt-user' relative to the adapter")


def test_export_keeps_tied_weights_tied_when_the_gathered_state_dict_copied_them(tmp_path):
    """A state dict consolidated from GPU shards holds the tied embedding and LM head as two CPU copies
    (on the CPU the gather returns one shared tensor). The export must still write one tied weight, as
    the model it came from has, merged LoRA or not (seen on an H100: the merged SFT model gained an
    lm_head.weight its base does not have)."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from rlhf.config.schema import ModelConfig
    from transformers import AutoTokenizer
    from rlhf.modeling.export import export_hf

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    tok = AutoTokenizer.from_pretrained(ROOT / "data" / "tokenizer")
    for lora in (False, True):
        cfg = ModelConfig()
        like = base
        if lora:
            cfg.lora.merge_on_save = True
            like = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
        copied = {k: v.detach().clone() for k, v in like.state_dict().items()}  # sharing lost, as a gather loses it
        out = tmp_path / f"lora_{lora}"
        export_hf(copied, like, tok, str(out), cfg, add_bos=True)
        keys = set(load_file(out / "model.safetensors"))
        assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys, sorted(keys)[:4]
        back = AutoModelForCausalLM.from_pretrained(out)
        assert back.lm_head.weight is back.model.embed_tokens.weight
        torch.testing.assert_close(back.model.embed_tokens.weight, copied[next(k for k in copied if "embed_tokens" in k)])
