#!/usr/bin/env python3
"""Drives one third-party agent tool wrapper, pinned and unmodified, the way an agent runtime
does, but with no model: the tool calls are written down in a plan.

    python drive.py <hubspot|zendesk|stripe> <plan.json>

plan.json is {"base": URL, "steps": [STEP, ...]}:

* base: where the wrapper sends its HTTP calls (the proxy and its prefix, e.g.
  http://127.0.0.1:8080/hubspot).
* a STEP is one of
  - {"tool": NAME, "args": {...}}: one tool call, in the agent's session;
  - {"parallel": [CALL, ...]}: calls made at once in that session (one agent making parallel
    tool calls);
  - {"agents": [CALL, ...]}: one agent per call, each with its own wrapper (its own MCP server
    process and session; for Stripe, its own thread): all are started and initialized first,
    then all make their call at the same moment.

hubspot starts @hubspot/mcp-server (node, tests/agents/node) and zendesk starts mcp-zendesk
(the console script beside this python), over MCP stdio in an empty temporary cwd, with the
python `mcp` client, and sends `tools/call` (no model). stripe calls stripe-agent-toolkit's
StripeAPI.run in-process (it has no MCP server), with stripe.api_base = base and
stripe-python's defaults otherwise (its own retries included).

Prints one JSON object on stdout: {"results": [RESULT, ...]}, one RESULT per step, where a
RESULT is {"tool", "text" (the text contents joined with newlines), "isError"}; a parallel or
agents step gives {"parallel": [RESULT, ...]} or {"agents": [RESULT, ...]}. Stripe results
also carry "value" (the parsed answer) or "error" (class, http_status, message = str(e),
user_message, code, should_retry).
"""

import asyncio
import json
import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
HUBSPOT_JS = HERE / "node" / "node_modules" / "@hubspot" / "mcp-server" / "dist" / "index.js"
# Bounds, so that a wedged wrapper fails the test instead of hanging it.
CALL_TIMEOUT = timedelta(seconds=60)

HUBSPOT_TOKEN = "pat-na1-agents-test-token"
ZENDESK_EMAIL = "agent@example.com"
ZENDESK_TOKEN = "zd-agents-test-token"
STRIPE_KEY = "sk_test_agents"


async def run_mcp(params, steps, errlog):
    from contextlib import AsyncExitStack

    from mcp import ClientSession
    from mcp.client.stdio import stdio_client

    async def call(session, step):
        result = {"tool": step["tool"]}
        try:
            r = await session.call_tool(step["tool"], step.get("args", {}), read_timeout_seconds=CALL_TIMEOUT)
        except Exception as e:  # a protocol error or a timeout: still a result
            result.update(text=f"{type(e).__name__}: {e}", isError=True, exception=True)
            return result
        texts = [c.text for c in r.content if getattr(c, "type", None) == "text"]
        result.update(text="\n".join(texts), isError=bool(r.isError))
        return result

    async with AsyncExitStack() as stack:

        async def start():
            # Entered one after another in this task (anyio's scopes must be left in the task
            # that entered them); each server process is spawned at once, so they start together.
            read, write = await stack.enter_async_context(stdio_client(params, errlog=errlog))
            return await stack.enter_async_context(ClientSession(read, write))

        main = None
        results = []
        for step in steps:
            if "agents" in step:
                sessions = [await start() for _ in step["agents"]]
                await asyncio.gather(*(s.initialize() for s in sessions))
                group = await asyncio.gather(*(call(s, a) for s, a in zip(sessions, step["agents"])))
                results.append({"agents": list(group)})
                continue
            if main is None:
                main = await start()
                await main.initialize()
            if "parallel" in step:
                group = await asyncio.gather(*(call(main, s) for s in step["parallel"]))
                results.append({"parallel": list(group)})
            else:
                results.append(await call(main, step))
        return results


def mcp_params(wrapper, base, cwd):
    from mcp import StdioServerParameters

    if wrapper == "hubspot":
        if not HUBSPOT_JS.exists():
            raise SystemExit(f"missing {HUBSPOT_JS}: run `npm ci` in {HERE / 'node'}")
        env = {
            "PATH": os.environ.get("PATH", ""),
            "BASE_URL_OVERRIDE": base,
            "PRIVATE_APP_ACCESS_TOKEN": HUBSPOT_TOKEN,
        }
        return StdioServerParameters(command="node", args=[str(HUBSPOT_JS)], env=env, cwd=cwd)
    env = {
        "PATH": os.environ.get("PATH", ""),
        "ZENDESK_BASE_URL": base,
        "ZENDESK_EMAIL": ZENDESK_EMAIL,
        "ZENDESK_API_TOKEN": ZENDESK_TOKEN,
    }
    script = Path(sys.executable).parent / "mcp-zendesk"
    if script.exists():
        return StdioServerParameters(command=str(script), args=[], env=env, cwd=cwd)
    return StdioServerParameters(
        command=sys.executable, args=["-c", "from mcp_zendesk import main; main()"], env=env, cwd=cwd
    )


def run_stripe(base, steps):
    from concurrent.futures import ThreadPoolExecutor

    import stripe
    from stripe_agent_toolkit.api import StripeAPI

    stripe.api_base = base
    api = StripeAPI(secret_key=STRIPE_KEY, context=None)
    error_class = getattr(stripe, "StripeError", None) or stripe.error.StripeError

    def call(step):
        result = {"tool": step["tool"]}
        try:
            out = api.run(step["tool"], **step.get("args", {}))
        except error_class as e:
            headers = {k.lower(): v for k, v in (e.headers or {}).items()}
            result.update(
                text=str(e),
                isError=True,
                error={
                    "class": type(e).__name__,
                    "http_status": e.http_status,
                    "message": str(e),
                    "user_message": e.user_message,
                    "code": e.code,
                    "should_retry": headers.get("stripe-should-retry"),
                },
            )
            return result
        result.update(text=out, isError=False, value=json.loads(out))
        return result

    results = []
    for step in steps:
        kind = next((k for k in ("parallel", "agents") if k in step), None)
        if kind:
            group = step[kind]
            with ThreadPoolExecutor(max_workers=len(group)) as pool:
                results.append({kind: list(pool.map(call, group))})
        else:
            results.append(call(step))
    return results


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in ("hubspot", "zendesk", "stripe"):
        raise SystemExit(__doc__)
    wrapper = sys.argv[1]
    plan = json.loads(Path(sys.argv[2]).read_text())
    base, steps = plan["base"], plan["steps"]
    if wrapper == "stripe":
        results = run_stripe(base, steps)
    else:
        with tempfile.TemporaryDirectory() as cwd, tempfile.TemporaryFile("w+") as errlog:
            # cwd: empty, since @hubspot/mcp-server loads ./.env (dotenv).
            try:
                results = asyncio.run(run_mcp(mcp_params(wrapper, base, cwd), steps, errlog))
            except BaseException:
                errlog.seek(0)
                sys.stderr.write(f"--- {wrapper} server stderr ---\n{errlog.read()[-8000:]}\n")
                raise
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main()
