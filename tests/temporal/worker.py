"""A Temporal workflow whose one activity updates a HubSpot contact through idemproxy.

The activity sends `X-Workflow-Id: <workflow id>:<activity id>`: the run part of the shipped
keys, the same on every attempt of the activity and different for the next activity, so a
retried attempt waits for, or replays, the first attempt's answer.

Usage: worker.py TEMPORAL_ADDRESS PROXY_URL START_TO_CLOSE_SECONDS WORKFLOW_ID
Prints one JSON line: the workflow's result (the attempt that finished, and the answer).
"""
import asyncio
import json
import sys
import urllib.error
import urllib.request
from datetime import timedelta

from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker

PROXY = sys.argv[2] if len(sys.argv) > 2 else ""


@activity.defn
def update_contact(contact_id: str) -> dict:
    info = activity.info()
    req = urllib.request.Request(
        f"{PROXY}/hubspot/crm/v3/objects/contacts/{contact_id}",
        data=json.dumps({"properties": {"firstname": "Ada"}}).encode(),
        method="PATCH",
        headers={
            "Authorization": "Bearer pat-temporal",
            "Content-Type": "application/json",
            "X-Workflow-Id": f"{info.workflow_id}:{info.activity_id}",
        },
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return {"attempt": info.attempt, "status": resp.status,
                    "replayed": resp.headers.get("Idempotent-Replayed"),
                    "body": json.loads(resp.read())}
    except urllib.error.HTTPError as e:
        # The proxy's 409/503/504 say a retry is safe: Temporal retries the activity.
        raise ApplicationError(f"{e.code} {e.headers.get('Idemproxy-Error')}", non_retryable=e.code < 409)


@workflow.defn
class ContactUpdate:
    @workflow.run
    async def run(self, contact_id: str, start_to_close: float) -> dict:
        return await workflow.execute_activity(
            update_contact,
            contact_id,
            start_to_close_timeout=timedelta(seconds=start_to_close),
            retry_policy=RetryPolicy(initial_interval=timedelta(milliseconds=200),
                                     backoff_coefficient=1.0, maximum_attempts=10),
        )


async def main():
    client = None
    for _ in range(100):
        try:
            client = await Client.connect(sys.argv[1])
            break
        except Exception:
            await asyncio.sleep(0.2)
    if client is None:
        raise SystemExit("no Temporal server at " + sys.argv[1])
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=4) as pool:
        async with Worker(client, task_queue="idem", workflows=[ContactUpdate],
                          activities=[update_contact], activity_executor=pool):
            result = await client.execute_workflow(
                ContactUpdate.run, args=["9801", float(sys.argv[3])], id=sys.argv[4],
                task_queue="idem")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
