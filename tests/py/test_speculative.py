"""Speculative decoding end to end: `serval generate` and `serval serve` with prompt lookup and a draft
model give exactly the text of plain decoding, report what they accepted (summary line, /metrics),
and refuse bad flags and request fields with a message naming them."""
import time

import openai
import pytest

from conftest import DATA, MODELS, cached_model, run
from server_util import Server

MODEL = "qwen2.5-coder-0.5b-instruct"
STORIES = MODELS / "stories260K.gguf"
EDIT = [{"role": "user", "content": "Rename the variable `total` to `acc` and return the whole code.\n\n"
         "def sum_list(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total\n"}]


@pytest.mark.parametrize("flags", [["--spec", "ngram"], ["--spec", "suffix"], ["--spec", "suffix", "--spec-tree-width", "3"],
                                   ["--model-draft", STORIES],
                                   ["--model-draft", STORIES, "--draft-vocab", "300"],
                                   ["--model-draft", STORIES, "--draft-quantization", "q4_0"],
                                   ["--spec", "ngram+draft", "--model-draft", STORIES, "--draft-backoff", "2"],
                                   ["--spec", "suffix+draft", "--model-draft", STORIES]])
def test_generate_with_speculation_prints_the_plain_text(flags):
    args = ["generate", "-m", STORIES, "-p", "Once upon a time", "-n", 60, "--seed", 3]
    for temp in ["0", "0.9"]:
        plain = run(*args, "--temp", temp)
        spec = run(*args, "--temp", temp, *flags)
        assert spec.stdout == plain.stdout
        assert f"speculative {flags[1] if flags[0] == '--spec' else 'draft'}:" in spec.stderr
        assert "accepted" in spec.stderr
        assert "speculative" not in plain.stderr


@pytest.mark.parametrize("flags, message", [
    (["--spec", "medusa"], "unknown speculative method 'medusa'"),
    (["--spec", "draft"], "--model-draft"),
    (["--spec", "ngram", "--draft-max", "0"], "--draft-max must be 1..64"),
    (["--model-draft", MODELS / "TinyStories-656K-Q8_0.gguf"], "vocabulary has 2048 tokens, the target's 512"),
    (["--spec", "ngram", "extra"], "--spec ngram takes no second value (got 'extra')"),
    (["--spec", "ngram+draft"], "--spec ngram+draft needs a draft model (--model-draft FILE)"),
    (["--spec", "ngram+medusa"], "unknown speculative method 'ngram+medusa'"),
    (["--spec", "ngram+heads"], "--spec ngram+heads needs a heads file (--spec ngram+heads FILE"),
    (["--model-draft", STORIES, "--draft-backoff", "-1"], "--draft-backoff must be 0..1024 (got -1)"),
    (["--model-draft", STORIES, "--draft-vocab", "-1"], "--draft-vocab must be 0 (all) or more (got -1)"),
    (["--model-draft", STORIES, "--draft-quantization", "q9"], "unknown or unsupported tensor type 'q9'"),
    (["--spec", "ngram", "--spec-tree-width", "0"], "--spec-tree-width must be 1..64 (got 0)"),
    (["--spec", "ngram", "--spec-heads-p-min", "2"], "--spec-heads-p-min must be 0..1 (got 2)"),
    (["--spec", "heads", MODELS / "stories260K.gguf"], "not a decoding-heads file"),
    (["--spec", "suffix", "--spec-suffix-depth", "65"], "--spec-suffix-depth must be 1..64 (got 65)"),
    (["--spec", "suffix", "--spec-suffix-factor", "0"], "--spec-suffix-factor must be in (0, 64] (got 0)"),
    (["--spec", "suffix", "--spec-suffix-p-min", "2"], "--spec-suffix-p-min must be 0..1 (got 2)"),
    (["--spec", "suffix", "--spec-suffix-cache", "-1"], "--spec-suffix-cache must be 0..1000000 (got -1)"),
    (["--spec", "ngram+suffix"], "unknown speculative method 'ngram+suffix'"),
    (["--spec", "suffix+draft"], "--spec suffix+draft needs a draft model (--model-draft FILE)"),
])
def test_bad_speculative_flags_are_clear_errors(flags, message):
    p = run("generate", "-m", STORIES, "-p", "Once", "-n", 4, *flags, check=False)
    assert p.returncode != 0
    assert message in p.stderr, p.stderr
    assert "Aborted" not in p.stderr and "terminate called" not in p.stderr


@pytest.fixture(scope="module")
def server():
    s = Server(cached_model(MODEL), "--spec", "ngram", "--draft-max", 8, name=MODEL)
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def settled_metric(server, name):
    """The counter once the engine's last step is published (the reply can arrive before it)."""
    value = server.metric(name)
    for _ in range(50):
        time.sleep(0.1)
        again = server.metric(name)
        if again == value:
            return value
        value = again
    return value


def test_server_speculation_is_lossless_and_counted(server, client):
    drafts_before = settled_metric(server, "serval:spec_decode_num_draft_tokens_total")
    accepted_before = settled_metric(server, "serval:spec_decode_num_accepted_tokens_total")
    spec = client.chat.completions.create(model=MODEL, messages=EDIT, max_tokens=60, temperature=0)
    proposed = settled_metric(server, "serval:spec_decode_num_draft_tokens_total") - drafts_before
    accepted = settled_metric(server, "serval:spec_decode_num_accepted_tokens_total") - accepted_before
    assert proposed > 0 and 0 < accepted <= proposed
    assert server.metric("serval:spec_decode_num_accepted_tokens_per_pos_total") >= accepted
    off = client.chat.completions.create(model=MODEL, messages=EDIT, max_tokens=60, temperature=0,
                                         extra_body={"speculative": False})
    assert settled_metric(server, "serval:spec_decode_num_draft_tokens_total") - drafts_before == proposed, "off means off"
    assert spec.choices[0].message.content == off.choices[0].message.content
    assert spec.usage.completion_tokens == off.usage.completion_tokens
    # Streaming, sampled with a seed, with a per-request cap: the same text as without speculation.
    kw = dict(model=MODEL, messages=EDIT, max_tokens=40, temperature=0.8, seed=5)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        stream=True, extra_body={"speculative": {"draft_max": 3}}, **kw) if c.choices)
    plain = client.chat.completions.create(extra_body={"speculative": {"enabled": False}}, **kw)
    assert streamed == plain.choices[0].message.content


@pytest.mark.parametrize("value, message", [
    ("yes", "'speculative' must be a boolean or an object"),
    ({"draft_max": -1}, "draft_max must be 0..64"),
    ({"draft_max": 1000}, "draft_max must be 0..64"),
    ({"draft_max": "4"}, "'draft_max' must be an integer"),
    ({"n_max": 4}, "unknown field 'speculative.n_max'"),
    ({"enabled": 1}, "'enabled' must be a boolean"),
])
def test_bad_speculative_field_is_a_400_naming_it(server, value, message):
    status, body, _ = server.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                      "speculative": value})
    assert status == 400, body
    assert message in body["error"]["message"]
    assert body["error"]["param"] == "speculative"


def test_suffix_speculation_proposes_from_earlier_answers_over_http():
    """An agent loop asks the same thing again: with --spec suffix the server proposes from the first
    answer, so the second is verified in far fewer steps, and both answers are the plain one."""
    s = Server(cached_model(MODEL), "--spec", "suffix", "--draft-max", 8, name=MODEL)
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        ask = dict(model=MODEL, messages=EDIT, max_tokens=60, temperature=0)
        counts = []
        answers = []
        for _ in range(2):
            before = settled_metric(s, "serval:spec_decode_num_accepted_tokens_total")
            answers.append(client.chat.completions.create(**ask))
            counts.append(settled_metric(s, "serval:spec_decode_num_accepted_tokens_total") - before)
        off = client.chat.completions.create(**ask, extra_body={"speculative": False})
        assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
        assert answers[1].choices[0].message.content == off.choices[0].message.content
        n = answers[1].usage.completion_tokens
        # At most 8 of every 9 tokens are accepted guesses; the first steps have no earlier answer to match.
        assert counts[1] >= 0.7 * n, (counts, n)
        assert counts[1] > counts[0], counts
    finally:
        assert s.stop() == 0


def test_llama_server_flat_n_max_is_accepted(server):
    status, body, _ = server.post("/v1/completions", {"model": MODEL, "prompt": "a a a a a a", "max_tokens": 4,
                                                      "temperature": 0, "speculative.n_max": 2})
    assert status == 200, body


def test_train_heads_reads_chat_markup_as_special_tokens_with_parse_special(tmp_path):
    """A corpus of chat transcripts: with --parse-special, <|im_start|> is one token the heads can propose
    (token 151644 in the heads' vocabulary); without it, the text is split into ordinary tokens."""
    from gguf import GGUFReader
    corpus = tmp_path / "chat.txt"
    corpus.write_text("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n" * 40)
    vocab = {}
    for flags in [[], ["--parse-special"]]:
        heads = tmp_path / f"heads{len(flags)}.gguf"
        run("train-heads", "-m", cached_model(MODEL), "-f", corpus, "-o", heads, "--heads", 1, "--vocab", 8, "-c", 64,
            "--tokens", 256, "--epochs", 1, "-t", 2, "--labels", "corpus", *flags)
        tensor = next(t for t in GGUFReader(heads).tensors if t.name == "heads.vocab")
        vocab[bool(flags)] = {int(i) for i in tensor.data}
    assert 151644 in vocab[True] and 151645 in vocab[True]
    assert 151644 not in vocab[False] and 151645 not in vocab[False]


def test_train_heads_rejects_an_unknown_label_source(tmp_path):
    p = run("train-heads", "-m", STORIES, "-f", DATA / "tinystory.txt", "-o", tmp_path / "h.gguf", "--labels", "both",
            check=False)
    assert p.returncode != 0 and "--labels" in p.stderr and "both" in p.stderr
    assert not (tmp_path / "h.gguf").exists()


def story_transcripts(folder, n=12):
    """n small documents, one per file: a question from the story's sentences, then an answer."""
    sentences = [s.strip() + "." for s in (DATA / "tinystory.txt").read_text().split(".") if len(s.strip()) > 20]
    folder.mkdir()
    for i in range(n):
        q, a = sentences[i % len(sentences)], " ".join(sentences[(i + 1 + j) % len(sentences)] for j in range(3))
        (folder / f"{i:02d}.txt").write_text(f"Question: {q}\nAnswer: {a}\n")
    return folder


def held_out(stderr):
    """Per head: (right, labelled) of its held-out top-1 line."""
    import re
    return [tuple(map(int, m)) for m in re.findall(r"\((\d+) of (\d+) held-out", stderr)]


def test_train_heads_reads_each_file_from_its_start_and_keeps_the_forward_pass_with_states(tmp_path):
    """Documents shorter than the window are each read from their own start; --states keeps the forward
    pass's results, and a second run that reads them trains the very same heads."""
    corpus, states = story_transcripts(tmp_path / "docs"), tmp_path / "states.bin"
    args = ["train-heads", "-m", STORIES, "-f", corpus, "--heads", 2, "--vocab", 64, "-c", 256, "--tokens", 100000,
            "--epochs", 1, "-t", 2, "--states", states]
    first = run(*args, "-o", tmp_path / "a.gguf")
    assert "wrote " + str(states) in first.stderr and "in 12 segments" in first.stderr
    second = run(*args, "-o", tmp_path / "b.gguf")
    assert "read the forward pass's results from " + str(states) in second.stderr
    assert "forward  [" not in second.stderr
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
    assert held_out(first.stderr) == held_out(second.stderr)
    # Another corpus, or other labels, and the states file is refused (it is not overwritten).
    before, text = states.read_bytes(), (corpus / "00.txt").read_text()
    (corpus / "00.txt").write_text("Question: Who? Answer: Nobody at all, said the cat to the dog.\n")
    other = run(*args, "-o", tmp_path / "c.gguf", check=False)
    assert other.returncode == 1 and "was made from another model or corpus" in other.stderr
    (corpus / "00.txt").write_text(text)
    labels = run(*args, "-o", tmp_path / "c.gguf", "--labels", "corpus", check=False)
    assert labels.returncode == 1 and "was made with other --labels" in labels.stderr
    assert states.read_bytes() == before and not (tmp_path / "c.gguf").exists()


def test_train_heads_with_a_response_template_learns_only_the_answers(tmp_path):
    """--response-template: rows before the template's last occurrence carry no label, so fewer held-out
    tokens are scored than without it, and still some."""
    corpus = story_transcripts(tmp_path / "docs", n=16)
    args = ["train-heads", "-m", STORIES, "-f", corpus, "--heads", 1, "--vocab", 64, "-c", 256, "--tokens", 100000,
            "--epochs", 1, "-t", 2, "-o", tmp_path / "h.gguf"]
    whole = held_out(run(*args).stderr)
    answers = held_out(run(*args, "--response-template", "Answer:").stderr)
    assert len(whole) == len(answers) == 1
    assert 0 < answers[0][1] < whole[0][1]
    # A template no document holds: every document is trained whole.
    assert held_out(run(*args, "--response-template", "Reply from the moon:").stderr) == whole


def test_train_heads_recurrent_writes_chained_heads_that_generate_uses_losslessly(tmp_path):
    """--recurrent: token-input heads chained on features, flagged in the file; generate with them prints
    the plain text."""
    from gguf import GGUFReader
    heads = tmp_path / "recurrent.gguf"
    p = run("train-heads", "-m", STORIES, "-f", story_transcripts(tmp_path / "docs"), "-o", heads, "--heads", 3,
            "--vocab", 64, "-c", 256, "--tokens", 100000, "--epochs", 1, "-t", 2, "--recurrent")
    assert len(held_out(p.stderr)) == 3
    fields = GGUFReader(heads).fields
    assert int(fields["serval-heads.recurrent"].parts[-1][0]) == 1 and int(fields["serval-heads.token_input"].parts[-1][0]) == 1
    args = ["generate", "-m", STORIES, "-p", "Once upon a time", "-n", 40, "--temp", 0]
    spec = run(*args, "--spec", "heads", heads)
    assert spec.stdout == run(*args).stdout and "speculative heads" in spec.stderr


def test_train_heads_writes_heads_and_a_loss_png_that_generate_uses(tmp_path):
    heads, png = tmp_path / "heads.gguf", tmp_path / "loss.png"
    p = run("train-heads", "-m", STORIES, "-f", DATA / "tinystory.txt", "-o", heads,
            "--heads", 2, "--vocab", 128, "-c", 64, "--tokens", 4096, "--self-distill", "--prompt-len", 8,
            "--loss-png", png)
    assert "head 0: validation loss" in p.stderr and "head 1: validation loss" in p.stderr
    # By default the heads learn the model's own predictions (--labels model), and say how often those
    # are the corpus's next token.
    assert "held-out model tokens" in p.stderr and "the model's own prediction is the corpus's next token at" in p.stderr
    assert heads.stat().st_size > 2 * 64 * 64 * 4
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    args = ["generate", "-m", STORIES, "-p", "Once upon a time", "-n", 40, "--temp", 0]
    spec = run(*args, "--spec", "heads", heads)
    assert spec.stdout == run(*args).stdout
    assert "speculative heads" in spec.stderr
