"""The request chat template sandbox: a template renders exactly as transformers renders it, in
a worker process with time and memory limits. A template past a limit is a 400 and its worker
is killed and replaced (the next request renders); its memory is the worker's, never this
process's; jinja's sandbox still refuses Python internals; concurrent renders each get their
own answer; nothing starts before the first request template."""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from huggingfaceserver.protocols.kserve_model import BackendModel
from huggingfaceserver.protocols.openai.chat_template import render_request_template
from huggingfaceserver.protocols.openai.template_sandbox import (
    MAX_MEMORY_BYTES,
    MAX_SECONDS,
    TemplateFailed,
    TemplateLimit,
    TemplateSandbox,
    TemplateWorker,
    sandbox,
)
from huggingfaceserver.protocols.openai.template_worker import encode
from tests.harness import client_for, descendants, load_model, run_server, wait_until

TOKENIZE = "/openai/v1/tokenize"
USER = [{"role": "user", "content": "Hello world"}]
TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
# What transformers gives a template: messages (None values dropped, reasoning aliased), tools,
# documents, kwargs, special tokens; its filters and globals; loop controls, the generation tag.
RICH = """
{%- set ns = namespace(n=0) %}
{{- bos_token }}{% if tools %}TOOLS {{ tools | tojson }}{% endif %}
{%- for d in documents or [] %}[doc {{ loop.index }}: {{ d.title }}]{% endfor %}
{%- for m in messages %}
  {%- set ns.n = ns.n + 1 %}
<{{ m.role }}>{% if m.thinking is defined %}<think>{{ m.thinking }}</think>{% endif %}
  {%- generation %}{{ m.content | trim }}{% endgeneration %}
  {%- if m.name is not defined %}(no name){% endif %}{{ eos_token }}
  {%- if loop.index >= 5 %}{% break %}{% endif %}
{%- endfor %}
{{ ns.n }} {{ dict(a=[1, 'é']) | tojson(indent=1) }} {{ '%s|%d' % ('x', 3) }}
{%- if not enable_thinking %}/no_think{% endif %}
{%- if add_generation_prompt %}<assistant>{% endif %}
"""
RICH_MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": " Be terse. ", "name": None},
    {"role": "user", "content": "Weather in Paris, ça va ?"},
    {"role": "assistant", "content": "Sunny.", "reasoning_content": "look it up"},
]
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
DOCUMENTS = [{"title": "Paris", "text": "Capital of France."}]

TOO_LONG = {
    "python loop": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
    "{% endfor %}",
    "one C call": "{{ (3 ** 100000000) % 7 }}",  # one power, minutes of C: no Python between
}
TOO_BIG = {
    "one string": "{{ 'x' * 10**10 }}",
    "growing": "{% set ns = namespace(x=[]) %}{% for i in range(600) %}"
    "{% set ns.x = ns.x + ['x' * (2**20 + i)] %}{% endfor %}{{ ns.x | length }}",
}
INTERNALS = {
    "class mro": "{{ ''.__class__.__mro__ }}",
    "function globals": "{{ cycler.__init__.__globals__ }}",
    "format attribute": "{{ '{0.__class__.__mro__}'.format('') }}",
    "namespace underscore": "{% set ns = namespace() %}{% set ns._x = 1 %}{{ ns._x }}",
}


@pytest.fixture(scope="module")
def trusting(tiny_models: dict[str, Path]) -> BackendModel:
    path = tiny_models["llama"]
    return load_model(
        [
            *("--model_dir", str(path), "--model_name", "llama", "--backend", "huggingface"),
            "--trust_request_chat_template",
        ]
    )


@pytest.fixture(scope="module")
def tokenizer(tiny_models: dict[str, Path]) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_models["llama"])


async def tokenize(model: BackendModel, template: str, **fields: Any) -> httpx.Response:
    body = {"messages": USER, "chat_template": template, **fields}
    async with client_for(model) as client:
        return await client.post(TOKENIZE, json=body)


def refusal(response: httpx.Response, param: str | None = "chat_template") -> str:
    """The 400's message (a limit names the parameter; a template's own error does not)."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    message = error["message"]
    assert isinstance(message, str)
    return message


def expected_ids(tokenizer: PreTrainedTokenizerBase, template: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        USER, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


async def assert_renders(model: BackendModel, tokenizer: PreTrainedTokenizerBase) -> None:
    response = await tokenize(model, TEMPLATE)
    assert response.status_code == 200, response.text
    assert response.json()["tokens"] == expected_ids(tokenizer, TEMPLATE)


def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_a_rich_template_renders_as_transformers_renders_it(tokenizer, generation_prompt):
    variables = {"tools": TOOLS, "documents": DOCUMENTS, "enable_thinking": False}
    expected = tokenizer.apply_chat_template(
        RICH_MESSAGES,
        chat_template=RICH,
        tokenize=False,
        add_generation_prompt=generation_prompt,
        **variables,
    )
    rendered = render_request_template(
        tokenizer, RICH, RICH_MESSAGES, generation_prompt, False, variables
    )
    assert rendered == expected
    assert "TOOLS" in rendered and "[doc 1: Paris]" in rendered and "<think>" in rendered


async def test_a_request_template_makes_the_ids_transformers_makes(trusting, tokenizer):
    await assert_renders(trusting, tokenizer)


@pytest.mark.parametrize("template", TOO_LONG.values(), ids=list(TOO_LONG))
async def test_a_template_that_runs_too_long_is_a_400_and_its_worker_is_replaced(
    trusting, tokenizer, template
):
    await asyncio.to_thread(sandbox.warm)  # the render alone is timed, not a worker's start
    [before] = sandbox.pids()
    started = time.monotonic()
    message = refusal(await tokenize(trusting, template))
    elapsed = time.monotonic() - started
    assert message == f"the chat template ran longer than its limit of {MAX_SECONDS:g} s"
    assert MAX_SECONDS <= elapsed < MAX_SECONDS + 1
    assert not running(before)  # killed, whatever it was running (and reaped)
    await assert_renders(trusting, tokenizer)  # by the next worker
    assert sandbox.pids() != [before]


@pytest.mark.parametrize("template", TOO_BIG.values(), ids=list(TOO_BIG))
async def test_a_template_that_allocates_too_much_is_a_400_outside_this_process(
    trusting, tokenizer, template
):
    await asyncio.to_thread(sandbox.warm)
    [before] = sandbox.pids()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    message = refusal(await tokenize(trusting, template))
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak
    limit = f"more memory than its limit of {MAX_MEMORY_BYTES // 2**20} MiB"
    assert limit in message
    assert grown < MAX_MEMORY_BYTES // 4, grown  # the template's gigabytes were the worker's
    assert not running(before)
    await assert_renders(trusting, tokenizer)


def test_the_worker_runs_under_cpu_and_memory_limits():
    sandbox.warm()
    [pid] = sandbox.pids()
    limits = Path(f"/proc/{pid}/limits")
    if not limits.exists():
        pytest.skip("no /proc here")
    soft = {line[:26].strip(): line[26:].split()[0] for line in limits.read_text().splitlines()[1:]}
    assert soft["Max cpu time"] != "unlimited"
    assert soft["Max core file size"] == "0"
    size = int(Path(f"/proc/{pid}/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    assert size < int(soft["Max address space"]) <= size + MAX_MEMORY_BYTES


@pytest.mark.parametrize("template", INTERNALS.values(), ids=list(INTERNALS))
async def test_the_sandbox_refuses_python_internals_with_a_400(trusting, template):
    message = refusal(await tokenize(trusting, template), param=None)
    assert "the chat template failed" in message
    assert "SecurityError" in message and ("unsafe" in message or "underscore" in message)


async def test_an_unsafe_attribute_renders_as_nothing(trusting, tokenizer):
    """jinja's rule: ``''.__class__`` is undefined (empty); only using it is an error."""
    response = await tokenize(trusting, "[{{ ''.__class__ }}]", add_special_tokens=False)
    assert response.status_code == 200, response.text
    assert response.json()["tokens"] == tokenizer("[]", add_special_tokens=False)["input_ids"]


def test_a_template_error_is_the_templates_exception():
    with pytest.raises(TemplateFailed, match="^no such thing$") as raised:
        sandbox.render("{{ raise_exception('no such thing') }}", USER, True, False, {})
    assert repr(raised.value) == "TemplateError('no such thing')"  # the 400 shows this


def test_concurrent_renders_each_get_their_own_answer():
    pool = TemplateSandbox(workers=2)
    try:
        assert pool.pids() == []  # nothing before the first render
        assert pool.render("{{ messages[0].content }}", USER, True, False, {}) == "Hello world"
        assert len(pool.pids()) == 1  # one render needed one worker

        def render(index: int) -> str:
            if index == 3:  # one template runs too long meanwhile: its worker is replaced
                with pytest.raises(TemplateLimit, match="limit of"):
                    pool.render(TOO_LONG["python loop"], USER, True, False, {})
                return "stopped"
            messages = [{"role": "user", "content": f"message {index} " + "é" * index}]
            return pool.render(
                "{{ messages[0].content }}|{{ n }}", messages, True, False, {"n": index}
            )

        with ThreadPoolExecutor(8) as threads:
            answers = list(threads.map(render, range(16)))
        expected = [f"message {i} " + "é" * i + f"|{i}" for i in range(16)]
        expected[3] = "stopped"
        assert answers == expected
        assert len(pool.pids()) == 2
    finally:
        pool.close()
    assert pool.pids() == []


def test_a_worker_that_died_idle_is_replaced():
    pool = TemplateSandbox()
    try:
        pool.warm()
        [worker] = pool.workers
        assert worker.process is not None
        worker.process.kill()
        worker.process.wait()  # dead before the next request, not during it
        assert pool.render("{{ messages[0].content }}", USER, True, False, {}) == "Hello world"
    finally:
        pool.close()


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="no /proc here")
def test_a_worker_that_dies_while_rendering_is_a_400_and_is_replaced():
    pool = TemplateSandbox()
    try:
        pool.warm()
        [pid] = pool.pids()
        idle = cpu_ticks(pid)
        with ThreadPoolExecutor(1) as thread:
            render = thread.submit(pool.render, TOO_LONG["python loop"], USER, True, False, {})
            deadline = time.monotonic() + MAX_SECONDS / 2
            while cpu_ticks(pid) == idle and time.monotonic() < deadline:
                pass  # until the worker is rendering
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(
                TemplateLimit, match=r"ended its worker process \(killed by SIGKILL"
            ):
                render.result()
        assert pool.render("{{ messages[0].content }}", USER, True, False, {}) == "Hello world"
    finally:
        pool.close()


def test_a_worker_left_rendering_stops_at_its_cpu_limit():
    """What happens when the server dies mid-render: nobody kills the worker, the kernel does."""
    worker = TemplateWorker()
    try:
        worker.wait_ready()
        request = {
            "template": TOO_LONG["python loop"],
            "messages": USER,
            "add_generation_prompt": True,
            "continue_final_message": False,
            "variables": {},
        }
        worker.send(encode(request))  # and never read the reply
        assert worker.process is not None
        assert worker.process.wait(timeout=120) == -signal.SIGXCPU
    finally:
        worker.stop()


def test_importing_starts_no_worker():
    code = (
        "import huggingfaceserver.protocols.openai.prompts\n"
        "from huggingfaceserver.protocols.openai.template_sandbox import sandbox\n"
        "print(sandbox.pids())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_a_server_renders_request_templates_in_workers_it_kills_and_leaves_none(
    tiny_models, tokenizer, layout, tmp_path
):
    """``python -m huggingfaceserver`` as a user starts it (one process, or fronts behind an
    engine): each process that renders starts its own worker; a looping template is a 400, its
    worker is killed and the next template renders; stopping the server leaves no worker."""
    args = ["--model_dir", str(tiny_models["llama"]), "--model_name", "llama"]
    args += ["--backend", "huggingface", "--trust_request_chat_template", *layout]
    seen = []
    with run_server(args, tmp_path) as server:

        def post(template: str) -> httpx.Response:
            body = {"messages": USER, "chat_template": template}
            return httpx.post(f"{server.url}/openai/v1/tokenize", json=body, timeout=60)

        def workers() -> list[Any]:
            below = descendants(server.process.pid)
            return [p for p in below if "template_worker.py" in p.cmdline]

        for _ in range(2):
            ok = post(TEMPLATE)
            assert ok.status_code == 200, ok.text
            assert ok.json()["tokens"] == expected_ids(tokenizer, TEMPLATE)
            seen += workers()
            refused = post(TOO_LONG["python loop"])
            assert refused.status_code == 400, refused.text
            assert f"limit of {MAX_SECONDS:g} s" in refused.json()["error"]["message"]
            seen += workers()
        assert seen and all(p.cmdline.split()[1] == "-I" for p in seen)
        assert any(not p.alive() for p in seen)  # killed at the deadline
    assert wait_until(lambda: not any(p.alive() for p in seen), timeout=30), seen
