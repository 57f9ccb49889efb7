"""Third-party clients work unchanged against kvrelay (issue #12): LangChain's
`ChatOpenAI`, LiteLLM's `completion` with the `openai/` provider, and the `guidellm`
benchmark CLI, each against the API of the tiny engine on a real socket. They come from
requirements-clients.txt, which `make test` installs. Nothing here reaches a network: the
clients are pointed at the local server, LiteLLM reads its bundled model map, and guidellm
takes the tiny model's tokenizer from its directory.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel

from api_helpers import serving
from kvrelay.server.openai_api import build_openai_app

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")   # no fetch of the model map at import
PROMPT = "Say something."


@pytest.fixture(scope="module")
def url(tiny_engine):
    with serving(build_openai_app(tiny_engine)) as u:
        yield u
    tiny_engine.check_idle()


class Answer(BaseModel):
    ok: bool
    colour: Literal["red", "green", "blue"]


def get_weather(city: Literal["Paris", "Rome"]) -> str:
    """The weather in a city."""
    return "sunny"


def test_langchain_chat_openai(url, tiny_engine):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=tiny_engine.model_name, base_url=f"{url}/v1", api_key="unused", temperature=0,
                     max_tokens=6, max_retries=0)
    reply = llm.invoke(PROMPT)
    assert reply.content and reply.response_metadata["finish_reason"] in ("stop", "length")
    assert reply.usage_metadata["output_tokens"] <= 6
    assert "".join(chunk.content for chunk in llm.stream(PROMPT)) == reply.content

    structured = ChatOpenAI(model=tiny_engine.model_name, base_url=f"{url}/v1", api_key="unused", max_tokens=40,
                            max_retries=0).with_structured_output(Answer)
    answer = structured.invoke(PROMPT)
    assert isinstance(answer, Answer) and answer.colour in ("red", "green", "blue")

    tools = llm.bind_tools([get_weather], tool_choice="required", strict=True)
    called = tools.invoke("Weather in Rome?", max_tokens=60)
    assert called.tool_calls and all(tc["name"] == "get_weather" and tc["args"]["city"] in ("Paris", "Rome")
                                      for tc in called.tool_calls)


def test_litellm_completion(url, tiny_engine):
    import litellm

    kw = dict(model=f"openai/{tiny_engine.model_name}", api_base=f"{url}/v1", api_key="unused",
              messages=[{"role": "user", "content": PROMPT}], max_tokens=5, temperature=0, ignore_eos=True)
    reply = litellm.completion(**kw)
    assert reply.choices[0].message.content and reply.usage.completion_tokens == 5
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in litellm.completion(**kw, stream=True))
    assert streamed == reply.choices[0].message.content
    two = litellm.completion(**{**kw, "temperature": 1.0}, n=2, seed=4)
    assert [c.index for c in two.choices] == [0, 1]


def test_guidellm_benchmark(url, tiny_engine, tiny_llama_dir, tmp_path):
    out = tmp_path / "benchmarks.json"
    cmd = [str(Path(sys.executable).with_name("guidellm")), "run",
           "--backend", f"kind=openai_http,target={url},model={tiny_engine.model_name}",
           "--profile", "kind=synchronous", "--constraint", "kind=max_requests,count=3",
           "--data", "kind=synthetic_text,prompt_tokens=16,output_tokens=6",
           "--tokenizer", f"kind=hf_auto,model={tiny_llama_dir}",
           "--output", f"kind=json,path={out}", "--disable-console"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    bench = json.loads(out.read_text())["benchmarks"][0]
    totals = bench["metrics"]["request_totals"]
    assert totals["successful"] == 3 and totals["errored"] == 0, totals
    assert bench["metrics"]["output_token_count"]["successful"]["total_sum"] == 3 * 6
