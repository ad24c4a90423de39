"""Drives the official stripe (Python) SDK, unmodified, through idemproxy.

Usage: stripe_python.py BASE_URL SCENARIO
BASE_URL is the proxy's Stripe prefix (http://127.0.0.1:PORT/stripe). Prints one JSON object:
what the SDK returned or raised. tests/sdk.rs asserts on it and on what the fake API received.
"""

import json
import sys
import threading
import uuid

import stripe

BASE, SCENARIO = sys.argv[1], sys.argv[2]
stripe.api_key = "sk_test_idemproxy"
stripe.api_base = BASE
stripe.max_network_retries = 2


def raised(f):
    """What an SDK call raised, as the test sees it."""
    try:
        f()
    except stripe.StripeError as e:
        return {
            "class": type(e).__name__,
            "status": e.http_status,
            # stripe-python's IdempotencyError keeps the message but drops `code`.
            "code": e.code or ((e.json_body or {}).get("error") or {}).get("code"),
            "message": e.user_message if e.user_message else str(e),
            "should_retry": (e.headers or {}).get("stripe-should-retry"),
        }
    return {"class": None}


def intent(order_id, amount=1000, customer="cus_1"):
    # A fresh metadata[request_id] per attempt, as agents and workflow nodes stamp them.
    return stripe.PaymentIntent.create(
        amount=amount,
        currency="usd",
        customer=customer,
        metadata={"order_id": order_id, "request_id": str(uuid.uuid4())},
    )


if SCENARIO == "create":
    c = stripe.Customer.create(email="ada@example.com")
    out = {"id": c.id, "object": c.object}
elif SCENARIO == "dropped":
    # The fake API processes this one, then drops the connection: the SDK's own retry must get
    # the object, and the API must have applied it once.
    c = stripe.Customer.create(email="dropped@example.com", metadata={"scenario": "dropped"})
    out = {"id": c.id, "replayed": c.last_response.headers.get("Idempotent-Replayed")}
elif SCENARIO == "same_intent":
    out = {"ids": [intent("order-1").id, intent("order-1").id]}
elif SCENARIO == "different_intent":
    out = {
        "ids": [
            intent("order-2").id,
            intent("order-3").id,
            intent("order-2", amount=2000).id,
            intent("order-2", customer="cus_2").id,
        ]
    }
elif SCENARIO == "deliberate_key":
    a = stripe.Customer.create(email="k@example.com", idempotency_key="signup-42")
    b = stripe.Customer.create(email="k@example.com", idempotency_key="signup-42")
    c = stripe.Customer.create(email="k@example.com", idempotency_key="signup-43")
    err = raised(lambda: stripe.Customer.create(email="other@example.com", idempotency_key="signup-42"))
    out = {"ids": [a.id, b.id, c.id], "reused": err}
elif SCENARIO == "concurrent_updates":
    results, threads = [], []

    def update(i):
        c = stripe.Customer.modify("cus_1", metadata={"n": str(i)})
        results.append(c.id)

    for i in range(4):
        t = threading.Thread(target=update, args=(i,))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    out = {"ids": sorted(results)}
elif SCENARIO == "errors":
    out = {
        # The shipped stripe-charges route serializes per customer: no customer, no charge.
        "entity_missing": raised(lambda: stripe.Charge.create(amount=100, currency="usd", source="tok_visa")),
    }
else:
    raise SystemExit(f"unknown scenario {SCENARIO}")

print(json.dumps(out))
