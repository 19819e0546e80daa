"""Preference tuning (method dpo on data.kind preference rows): the rows TRL's DPOTrainer tokenizes, the losses and
evaluation metrics it computes from the same adapters, and one line for rows and settings that cannot be trained."""

import json
import shutil
import math
import re

import pytest
import torch
from conftest import FIXTURES, backend_params, run_in_process, run_trainings, run_worker, runnable
from transformers import AutoModelForCausalLM, AutoTokenizer

from xla_shard import backends, config
from xla_shard.data import preference
from xla_shard.data.files import read_rows
from xla_shard.data.tokenize import IGNORE
from xla_shard.errors import ConfigError

pytestmark = pytest.mark.torch_version  # its subject depends on torch's version

PLAIN = FIXTURES / "preference.jsonl"
CHAT = FIXTURES / "preference_chat.jsonl"
LORA = ["model.lora.r=4", "model.lora.alpha=8"]
BACKENDS = {
    "xla_spmd": (["backend=xla_spmd", "cpu_devices=2"], 0),
    "torch_fsdp": (["backend=torch_fsdp"], 2),
}


def _cfg(model_dir, path, seq_len, *sets):
    return config.load(None, [f"model.name={model_dir}", f"data.path={path}", "method=dpo", "data.kind=preference",
                              f"train.seq_len={seq_len}", *LORA, *sets])


def _ours(model_dir, path, seq_len):
    cfg = _cfg(model_dir, path, seq_len)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return preference.examples(read_rows(str(path), None, "data.path"), tokenizer, preference.fields_of(cfg.data),
                               seq_len, 0, None, str(path))


def _trl_rows(model_dir, path, seq_len):
    """TRL's DPOTrainer's own preparation of the file: prompt_ids, chosen_ids, rejected_ids per row."""
    import datasets
    from trl import DPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = datasets.Dataset.from_list([json.loads(line) for line in path.read_text().splitlines()])
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), processing_class=tokenizer,
                         train_dataset=rows, args=_trl_args(path.parent / "unused", seq_len))
    return trainer.train_dataset


def _trl_args(out, seq_len, **args):
    from trl import DPOConfig

    return DPOConfig(output_dir=str(out), max_length=seq_len, report_to=[], use_cpu=True, bf16=False,
                     gradient_checkpointing=False, save_strategy="no", **args)


@pytest.mark.parametrize("path, seq_len", [(PLAIN, 64), (CHAT, 96), (CHAT, 40)])  # 40 cuts answers, drops rows
def test_rows_tokenize_as_trls(model_dirs, path, seq_len):
    """Each row's two sequences are TRL's prompt + chosen and prompt + rejected, cut at seq_len as its collator
    cuts them; the labels are the completion tokens; rows TRL drops (the prompt fills seq_len) are dropped."""
    pytest.importorskip("trl")
    ours, dropped = _ours(model_dirs.llama_chat, path, seq_len)
    theirs = _trl_rows(model_dirs.llama_chat, path, seq_len)
    assert len(ours) == len(theirs) and dropped == 8 - len(theirs) and (dropped > 0) == (seq_len == 40)
    for row, want in zip(ours, theirs):
        for ids, labels, mask, completion in zip(row["input_ids"], row["labels"], row["attention_mask"],
                                                 (want["chosen_ids"], want["rejected_ids"])):
            sequence = (want["prompt_ids"] + completion)[:seq_len]
            n = len(sequence)
            assert ids[:n] == sequence and sum(mask) == n and len(ids) == seq_len
            assert labels[:n] == ([IGNORE] * len(want["prompt_ids"]) + completion)[:seq_len]
            assert set(labels[n:]) <= {IGNORE}
    eos = AutoTokenizer.from_pretrained(model_dirs.llama_chat).eos_token_id
    if path == PLAIN:  # TRL's EOS after each plain-text completion
        assert all(r["chosen_ids"][-1] == eos and r["rejected_ids"][-1] == eos for r in theirs)


def _write(tmp_path, rows):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


GOOD = {"prompt": "Q: where?\nA:", "chosen": " by the river", "rejected": " no idea"}


@pytest.mark.parametrize("bad, key, words", [
    ({**GOOD, "chosen": None}, "data.chosen_field", "row 1: 'chosen' is missing"),
    ({**GOOD, "rejected": ""}, "data.rejected_field", "row 1: 'rejected' is empty"),
    ({**GOOD, "rejected": GOOD["chosen"]}, "data.rejected_field", "the same completion"),
    # the same once each completion ends with EOS, as TRL appends it
    ({**GOOD, "rejected": GOOD["chosen"] + "</s>"}, "data.rejected_field", "the same completion once tokenized"),
    # labels would start inside the user turn's chat header
    ({"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "user", "content": "a"}],
      "rejected": [{"role": "assistant", "content": "b"}]}, "data.chosen_field", "starts with a 'user' turn"),
    ({**GOOD, "chosen": [{"role": "assistant", "content": "x"}]}, "data.prompt_field", "all be text or all be lists"),
    ({"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "wizard", "content": "a"}],
      "rejected": [{"role": "assistant", "content": "b"}]}, "data.chosen_field", "unknown role 'wizard'"),
])
def test_a_row_that_cannot_be_compared_is_refused_naming_the_key_and_row(model_dirs, tmp_path, bad, key, words):
    path = _write(tmp_path, [GOOD, bad])
    with pytest.raises(ConfigError) as info:
        _ours(model_dirs.llama_chat, path, 64)
    assert info.value.key == key and words in str(info.value), str(info.value)


def test_text_far_past_seq_len_is_not_tokenized(model_dirs, tmp_path, monkeypatch):
    """An 8 MB text field is cut at the characters seq_len's tokens can come from before it is tokenized (it
    took GiBs and minutes whole); the row keeps the tokens it would have kept."""
    from transformers import PreTrainedTokenizerFast

    from xla_shard.data.completions import MAX_CHARS_PER_TOKEN

    seen, call = [], PreTrainedTokenizerFast.__call__

    def measured(self, *args, text=None, **kwargs):
        seen.append(len(text or ""))
        return call(self, *args, text=text, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerFast, "__call__", measured)
    long = {**GOOD, "chosen": " by the river" * 640_000}  # 8.3 MB
    kept, _ = _ours(model_dirs.llama_chat, _write(tmp_path, [GOOD, long]), 64)
    assert max(seen) <= len(GOOD["prompt"]) + MAX_CHARS_PER_TOKEN * 64 + 65536
    cut = kept[1]
    assert cut["labels"][0][-1] != -100 and len(cut["input_ids"][0]) == 64  # the chosen fills the row


@pytest.mark.parametrize("sets, words", [
    (["method=dpo", "data.kind=preference", *LORA, "data.completion_only_loss=true"], "always the completions'"),
    (["method=dpo", "data.kind=preference", *LORA, "dpo.label_smoothing=0.1"], "set dpo.loss_type: robust"),
    (["dpo.beta=0.5"], "dpo.beta applies to method dpo; method is sft"),
    (["data.kind=preference"], "data.kind preference rows train method dpo, and method is sft"),
    (["method=dpo"], "data.kind text rows train method sft, and method is dpo"),
    (["method=dpo", "data.kind=preference", "data.prompt_field=chosen"],
     "data.prompt_field and data.chosen_field both name"),
    (["data.kind=prompt_completion", "data.completion_field=prompt"], "both name the column 'prompt'"),
])
def test_settings_that_do_not_make_a_dpo_run_are_refused(sets, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        config.load(None, [f"data.path={PLAIN}", *sets])


@pytest.mark.xla
def test_xla_fsdp_refuses_dpo_naming_key_and_backend():
    cfg = config.load(None, [f"data.path={PLAIN}", "method=dpo", "data.kind=preference", "backend=xla_fsdp",
                             "cpu_devices=1"])
    with pytest.raises(ConfigError) as raised:
        backends.create(cfg)
    assert (raised.value.key, raised.value.backend) == ("method", "xla_fsdp")
    assert "frozen reference model" in str(raised.value)


def _common(model_dirs):
    return [f"model.name={model_dirs.llama_chat}", f"data.path={CHAT}", "method=dpo", "data.kind=preference",
            "train.seq_len=96", "train.global_batch_size=8", "train.optimizer=sgd", "train.steps=3",
            f"data.eval_path={CHAT}", "train.eval_every=3"]


METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
RUNS = {  # (Q)LoRA, its reference the adapters switched off; full fine-tuning, its reference another model
    "lora": [*LORA, "train.lr=1.0"],
    "qlora": [*LORA, "train.lr=1.0", "model.quantization.bnb_4bit_quant_type=nf4"],  # over a bitsandbytes base
    "full": ["train.lr=0.5", "dpo.reference={reference}"],
}


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory):
    from model_dirs import CHAT_TEMPLATE, llama_dir

    return llama_dir(tmp_path_factory.mktemp("reference") / "llama", seed=9, chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def trl_runs(model_dirs, reference_dir, tmp_path_factory):
    """tests/workers/trl_dpo.py's run of each of RUNS: (losses, evaluation)."""
    pytest.importorskip("trl")
    got = {}
    for name in RUNS:
        reference = str(reference_dir) if name == "full" else "-"
        done = run_worker("trl_dpo.py", str(CHAT), reference, *_common(model_dirs), *_run(name, reference_dir),
                          cwd=tmp_path_factory.mktemp("trl"), env={"USE_TORCH_XLA": "0"})
        result = json.loads(done.stdout.strip().splitlines()[-1])
        got[name] = result["losses"], result["logged"], result["eval"]
    return got


def _run(name, reference_dir):
    return [s.format(reference=reference_dir) for s in RUNS[name]]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_params(list(BACKENDS)))
def test_dpo_follows_trls_dpo_trainer(model_dirs, reference_dir, tmp_path, backend, trl_runs, capsys):
    """Conversational rows, every row in each step (so the order rows come in does not matter), SGD, evaluated
    on every row after step 3; one process for every run. With LoRA, and QLoRA over a 4-bit base against peft's
    over bitsandbytes', step 1's loss is ln 2 (the adapters start at zero, so the policy is its reference); fully
    fine-tuned against another model, it is not. Either way the
    losses follow DPOTrainer's, and each step and the evaluation report TRL's metrics under TRL's names. A run
    sent SIGTERM as step 2 ends stops with a checkpoint holding the policy and nothing of the reference, and
    resumes exactly; its last checkpoint exports as a model transformers loads."""
    sets, nproc = runnable(BACKENDS)[backend]
    ckpt = tmp_path / "ckpt"
    interrupted = {"stopped": [*_run("full", reference_dir), "sigterm_after=2", f"checkpoint.dir={ckpt}",
                               "checkpoint.every_steps=100"],
                   "resumed": [*_run("full", reference_dir), f"checkpoint.dir={ckpt}"]}
    got = run_trainings(tmp_path, [*_common(model_dirs), *sets],
                        {**{name: _run(name, reference_dir) for name in RUNS}, **interrupted}, nproc=nproc)
    # Resumed at step 2 (the reference read again, never checkpointed): step 3 and its evaluation, bitwise.
    def losses(records):
        return [(r["step"], r["loss"]) for r in records if "loss" in r]

    def evaluations(records):
        return [(r["step"], r["eval_loss"], r["eval_rewards/margins"]) for r in records if "eval_loss" in r]

    assert losses(got["stopped"] + got["resumed"]) == losses(got["full"])
    assert evaluations(got["resumed"]) == evaluations(got["full"])
    assert "SIGTERM: stopped after step 2; checkpoint committed" in (tmp_path / "train_runs.log").read_text()
    manifest = json.loads((ckpt / "step-00000002" / "manifest.json").read_text())
    policy = AutoModelForCausalLM.from_pretrained(model_dirs.llama_chat).state_dict()
    assert {n[len("model/"):] for n in manifest["tensors"] if n.startswith("model/")} == set(policy)
    # The trained policy exports as a model transformers loads: the starting one's tensors, changed by training.
    done = run_in_process(capsys, "ckpt", "export", str(ckpt / "step-00000003"), "--to", str(tmp_path / "export"))
    assert done.returncode == 0, done.stderr[-2000:]
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").state_dict()
    assert set(exported) == set(policy) and not torch.equal(exported["lm_head.weight"], policy["lm_head.weight"])
    for name in RUNS:
        records = got[name]
        losses = [r["loss"] for r in records if "loss" in r]
        evaluation = next(r for r in records if "eval_loss" in r)
        want, want_logged, want_eval = trl_runs[name]
        assert (losses[0] == pytest.approx(math.log(2), abs=1e-6)) == (name != "full"), (name, losses)
        assert losses == pytest.approx(want, rel=1e-5), (backend, name, losses, want)
        assert want[-1] < want[0]
        trained = [r for r in records if "loss" in r]
        for key in METRICS:  # each step's, as TRL logs them, and the evaluation's
            assert [r[key] for r in trained] == pytest.approx([w[key] for w in want_logged], rel=1e-4, abs=1e-6), \
                (name, key)
        for key in ("loss", *METRICS):
            assert evaluation[f"eval_{key}"] == pytest.approx(want_eval[f"eval_{key}"], rel=1e-4, abs=1e-6), \
                (name, key)


def test_the_reference_is_the_model_with_its_adapters_off(model_dirs):
    """Switched off, a LoRA model computes its base's logits exactly, whatever its adapters hold; switched on
    again, its own."""
    from xla_shard.methods import adapter_for

    cfg = _cfg(model_dirs.llama_chat, CHAT, 32)
    model = AutoModelForCausalLM.from_pretrained(model_dirs.llama_chat, attn_implementation="eager")
    base = model(input_ids=torch.arange(8)[None]).logits
    adapter = adapter_for(cfg)
    adapter.inject(model, "causal_lm", 0)
    for name, param in model.named_parameters():
        if ".lora_" in name:
            param.data.normal_()
    ids = torch.arange(8)[None]
    with torch.no_grad(), adapter.switched_off(model):
        off = model(input_ids=ids).logits
    torch.testing.assert_close(off, base, rtol=0, atol=0)
    assert not torch.allclose(model(input_ids=ids).logits, base)


def test_a_reference_that_is_no_model_or_reads_other_tokens_is_refused_before_anything_starts(model_dirs,
                                                                                               tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from xla_shard.train import preflight

    other = tmp_path / "other"
    LlamaForCausalLM(LlamaConfig(vocab_size=999, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(other)
    # the policy's vocabulary size and weights, but a tokenizer that reads two ids the other way round
    swapped = tmp_path / "swapped"
    shutil.copytree(model_dirs.llama_chat, swapped)
    tokenizer = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = (token for token, i in vocab.items() if i in (40, 41))
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (swapped / "tokenizer.json").write_text(json.dumps(tokenizer))
    for reference, words in ((tmp_path / "nowhere", "is neither a preset"), (other, "has 999 token embeddings"),
                             (swapped, "reads token ids as other text than the policy's")):
        with pytest.raises(ConfigError) as info:
            preflight(_cfg(model_dirs.llama_chat, PLAIN, 64, f"dpo.reference={reference}"))
        assert info.value.key == "dpo.reference" and words in str(info.value), str(info.value)
    assert "id 40" in str(info.value)
    preflight(_cfg(model_dirs.llama_chat, PLAIN, 64, f"dpo.reference={model_dirs.llama_chat}"))  # the same: fine


def test_a_reference_is_held_to_the_checks_the_policy_passes(model_dirs, tmp_path):
    """The policy's tokens, but fewer positions than train.seq_len (it used to fail at step 1, IndexError)."""
    from xla_shard.train import preflight

    short = tmp_path / "short"
    shutil.copytree(model_dirs.llama_chat, short)
    model_config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**model_config, "max_position_embeddings": 16}))
    with pytest.raises(ConfigError) as info:
        preflight(_cfg(model_dirs.llama_chat, PLAIN, 64, f"dpo.reference={short}"))
    assert info.value.key == "dpo.reference"
    assert "under train.seq_len: 64 is longer than the model's 16 positions" in str(info.value)
