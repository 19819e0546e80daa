"""Chat templates as an attacker (or a careless model card) writes them: each either renders within its bounds or
is refused in one line naming data.tokenizer and the row; nothing hangs, nothing fills the memory, and nothing
is blamed on the wrong key."""

import json
import time

import pytest
from model_dirs import CHAT_TEMPLATE, CHAT_TEMPLATE_MARKED, bpe_tokenizer

from xla_shard.data import chat_template, completions
from xla_shard.data.tokenize import IGNORE
from xla_shard.errors import ConfigError
from xla_shard.hostmem import peak_growth

ROW = [{"role": "user", "content": "Tell me about the river."}, {"role": "assistant", "content": "It runs south."}]
HANG = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
# Loops that neither write nor call anything between checks: only the timer stops them.
SILENT_HANG = "{% set r = range(100000) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}"
FLOOD = "{% for i in range(40000) %}{{ 'x' * 1000 }}{% endfor %}" + CHAT_TEMPLATE  # 40 MB before the turns


@pytest.fixture(autouse=True)
def quick_bound(monkeypatch):
    """The same bound, shorter: a hang is stopped after 2 s instead of RENDER_SECONDS."""
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 2.0)


def _encode(template, rows, kind="chat", seq_len=64, completion_only=True, tokenizer=None):
    import datasets

    tokenizer = tokenizer or bpe_tokenizer(CHAT_TEMPLATE)
    tokenizer.chat_template = template
    fields = completions.CompletionFields(kind, "messages", "prompt", "completion", completion_only)
    return completions.examples(datasets.Dataset.from_list(rows), tokenizer, fields, seq_len, None, "rows.jsonl")


def _refused(template, rows, key="data.tokenizer", **options) -> str:
    with pytest.raises(ConfigError) as error:
        _encode(template, rows, **options)
    assert error.value.key == key, error.value
    assert "\n" not in str(error.value)
    return str(error.value)


@pytest.mark.parametrize("template", [HANG, SILENT_HANG], ids=["calls", "silent"])
def test_a_template_that_never_ends_is_stopped_within_its_time(template):
    start = time.monotonic()
    message = _refused(template + CHAT_TEMPLATE, [{"messages": ROW}])
    assert time.monotonic() - start < chat_template.RENDER_SECONDS + 8
    assert "row 0" in message and "ran past" in message


def test_a_template_that_never_ends_is_stopped_outside_the_main_thread_too():
    import threading

    found = []
    thread = threading.Thread(target=lambda: found.append(pytest.raises(ConfigError, _encode, HANG + CHAT_TEMPLATE,
                                                                        [{"messages": ROW}])))
    thread.start()
    thread.join(chat_template.RENDER_SECONDS + 20)
    assert not thread.is_alive() and found and "ran past" in str(found[0].value)


def test_a_flooding_template_is_refused_before_anything_is_tokenized():
    with peak_growth() as growth:
        message = _refused(FLOOD, [{"messages": ROW}])
    assert "row 0" in message and "characters" in message
    assert growth.bytes < 200 * 2**20  # tokenizing 40 MB took gigabytes


def test_a_flood_is_cut_where_every_token_is_labelled():
    """With completion_only_loss off the labels are the tokens, so the rendering is cut at its bound and the
    first seq_len tokens are those of the uncut rendering."""
    tokenizer = bpe_tokenizer(CHAT_TEMPLATE)
    small = "{% for i in range(3) %}{{ 'river town ' * 20 }}{% endfor %}" + CHAT_TEMPLATE
    tokenizer.chat_template = small
    whole = tokenizer.apply_chat_template(ROW, tokenize=True, return_dict=True)["input_ids"]
    rows, dropped = _encode(FLOOD.replace("'x' * 1000", "'river town ' * 20"), [{"messages": ROW}],
                            completion_only=False, seq_len=32)
    assert dropped == 0 and rows[0]["input_ids"] == whole[:32] and rows[0]["labels"] == whole[:32]


def test_named_templates_use_default_as_transformers_does():
    tokenizer = bpe_tokenizer(CHAT_TEMPLATE)
    expected, _ = _encode(CHAT_TEMPLATE, [{"messages": ROW}], tokenizer=bpe_tokenizer(CHAT_TEMPLATE))
    for named in ({"default": CHAT_TEMPLATE, "tool_use": "{{ 'tools' }}"},
                  [{"name": "tool_use", "template": "{{ 'tools' }}"}, {"name": "default", "template": CHAT_TEMPLATE}]):
        got, _ = _encode(named, [{"messages": ROW}], tokenizer=tokenizer)
        assert got[0] == expected[0]


def test_named_templates_without_a_default_are_refused():
    message = _refused({"tool_use": CHAT_TEMPLATE}, [{"messages": ROW}])
    assert "default" in message
    _refused([{"name": "x"}], [{"messages": ROW}])


# Assistant turns render as their header alone: the answer is never in the text.
HEADER_ONLY = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
               "{% if message['role'] != 'assistant' %}{{ message['content'] + '<|im_end|>\n' }}{% endif %}"
               "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_a_template_that_renders_no_answer_is_named_not_blamed_on_seq_len():
    message = _refused(HEADER_ONLY, [{"messages": ROW}])
    assert "as nothing" in message and "seq_len" not in message


def test_generation_in_a_comment_is_no_marker():
    """Once taken for markers (no token marked, every row dropped and blamed on seq_len); now the template is
    rendered turn by turn, as any unmarked one."""
    rows, dropped = _encode("{# {% generation %} #}" + CHAT_TEMPLATE, [{"messages": ROW}])
    plain, _ = _encode(CHAT_TEMPLATE, [{"messages": ROW}])
    assert dropped == 0 and rows[0]["labels"][-len(plain[0]["labels"]):] == plain[0]["labels"]
    assert any(label != IGNORE for label in rows[0]["labels"])


def test_generation_blocks_around_nothing_are_named():
    empty = CHAT_TEMPLATE_MARKED.replace("{% generation %}{{ message['content'] + '<|im_end|>\n' }}{% endgeneration %}",
                                         "{{ message['content'] + '<|im_end|>\n' }}{% generation %}{% endgeneration %}")
    message = _refused(empty, [{"messages": ROW}])
    assert "mark none" in message


def test_a_completion_that_is_a_user_turn_is_refused():
    rows = [{"prompt": [ROW[0]], "completion": [{"role": "user", "content": "and then?"}]}]
    message = _refused(CHAT_TEMPLATE, rows, key="data.completion_field", kind="prompt_completion")
    assert "'user'" in message and "row 0" in message


def test_marked_templates_keep_their_labels():
    """The bounds change nothing for a template within them: assistant tokens labelled, the rest not."""
    rows, _ = _encode(CHAT_TEMPLATE_MARKED, [{"messages": ROW}])
    plain, _ = _encode(CHAT_TEMPLATE, [{"messages": ROW}])
    assert rows[0] == plain[0] and 0 < sum(label != IGNORE for label in rows[0]["labels"]) < len(rows[0]["labels"])
    assert json.dumps(rows[0])  # plain data, as datasets stores it
