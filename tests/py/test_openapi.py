"""The OpenAPI description (src/server/openapi.json) against a live `serval serve`, with schemathesis:
examples generated from the description (valid and invalid requests) for every operation; no 5xx,
no crash, every status code, content type, header and body (JSON and each SSE event) as described.

The description is read from the server's GET /openapi.json when it answers 200, else from the
file, so the test runs before and after the server embeds it. Bounded: a fixed seed, a fixed number
of examples per operation and mode, stories260K with a 32-token context, and max_tokens capped at 8
and n at 4 in the copy of the description that generates valid requests (the file keeps the
server's bounds). Today's server fails GET /openapi.json (404) until it embeds the file."""
import copy
import json
import urllib.request

import hypothesis
import pytest
import schemathesis
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                               response_headers_conformance, response_schema_conformance,
                                               status_code_conformance)
from schemathesis.checks import not_a_server_error

from conftest import MODELS, ROOT
from server_util import Server

STORIES = MODELS / "stories260K.gguf"
STORIES_VOCAB = 512  # `serval info` on stories260K: token ids 0..511
SPEC_FILE = ROOT / "src" / "server" / "openapi.json"
MAX_TOKENS = 8
EXAMPLES = 25  # per operation and generation mode (positive, negative)
# negative_data_rejection: a request the description calls invalid must get a 4xx (the description
# states the bounds the server enforces). Its converse (every valid-looking request gets 2xx) cannot
# hold: the context limit on prompt tokens + max_tokens is not expressible in a schema.
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection]


def load_description(server):
    """The server's own description if it serves one, else the file; and where it came from."""
    try:
        with urllib.request.urlopen(server.url + "/openapi.json", timeout=10) as r:
            if r.status == 200:
                return json.load(r), "GET /openapi.json"
    except (OSError, ValueError):
        pass
    return json.loads(SPEC_FILE.read_text()), str(SPEC_FILE.relative_to(ROOT))


def for_server(doc, url, short):
    """A copy for generating requests: this server, stories260K's vocabulary and, for valid requests
    (`short`), max_tokens <= 8 and n <= 4. Invalid requests keep the real bounds, since a request
    past a tightened bound is valid to the server; the 32-token context bounds their generations."""
    doc = copy.deepcopy(doc)
    doc["servers"] = [{"url": url}]
    schemas = doc["components"]["schemas"]
    schemas["TokenId"]["maximum"] = STORIES_VOCAB - 1
    if short:
        for name in ("CompletionRequest", "ChatCompletionRequest"):
            for field in ("max_tokens", "max_completion_tokens"):
                schemas[name]["properties"][field]["maximum"] = MAX_TOKENS
            schemas[name]["properties"]["n"]["maximum"] = 4
    return doc


@pytest.fixture(scope="module")
def server():
    # A 32-token context bounds every generation, even chat's default "rest of the context".
    # --embeddings and --allow-runtime-lora: those routes answer for real (embeddings of the decoder,
    # adapter loads refused for their paths), not only with "not served here".
    s = Server(STORIES, "--max-model-len", 32, "--max-seqs", 16, "--embeddings", "--allow-runtime-lora")
    yield s
    assert s.proc.poll() is None, "the server died during the run"
    assert s.stop() == 0


@pytest.fixture(scope="module")
def api_schemas(server):
    doc, source = load_description(server)
    print(f"OpenAPI description from {source}")
    schemas = {}
    for mode in ("positive", "negative"):
        schema = schemathesis.openapi.from_dict(for_server(doc, server.url, short=mode == "positive"))
        schema.config.update(base_url=server.url)
        schemas[mode] = schema
    return schemas


def test_description_file_is_valid_openapi():
    doc = json.loads(SPEC_FILE.read_text())
    assert doc["openapi"].startswith("3.")
    paths = set(doc["paths"])
    for p in ["/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/health",
              "/metrics", "/engine/state", "/openapi.json", "/v1/embeddings", "/v1/rerank", "/score", "/lora-adapters",
              "/v1/load_lora_adapter", "/v1/unload_lora_adapter"]:
        assert p in paths, p
    for p in ["/v1/completions", "/v1/chat/completions"]:
        codes = set(doc["paths"][p]["post"]["responses"])
        assert {"200", "400", "401", "404", "413", "429", "503"} <= codes, (p, codes)
        assert {"application/json", "text/event-stream"} <= set(doc["paths"][p]["post"]["responses"]["200"]["content"])
    schemathesis.openapi.from_dict(doc)  # loads (schemathesis validates the document)


def test_served_description_matches_file(server):
    """Once the server embeds the file, GET /openapi.json must return it unchanged."""
    doc, source = load_description(server)
    if source != "GET /openapi.json":
        pytest.xfail("this server does not serve /openapi.json yet")
    assert doc == json.loads(SPEC_FILE.read_text())


OPERATIONS = [(method.upper(), path) for path, item in json.loads(SPEC_FILE.read_text())["paths"].items()
              for method in item]


@pytest.mark.parametrize("mode", ["positive", "negative"])
@pytest.mark.parametrize("method,path", OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_api_conforms(api_schemas, server, method, path, mode):
    operation = api_schemas[mode][path][method]
    if mode == "negative" and "requestBody" not in operation.definition.raw:
        pytest.skip("no request body to make invalid")

    @hypothesis.given(operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode)))
    @hypothesis.settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    def conforms(case):
        case.call_and_validate(checks=CHECKS, timeout=60)
        assert server.proc.poll() is None, "the server crashed"

    conforms()


def test_still_serving_after_the_run(server):
    assert server.get("/health")[0] == 200
    st, body, _ = server.post("/v1/completions", {"prompt": "Once", "max_tokens": 4, "temperature": 0})
    assert st == 200 and body["usage"]["completion_tokens"] == 4
