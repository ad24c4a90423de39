-- Every request carries the same key and body: after the first, all are replays.
wrk.method = "POST"
wrk.path = "/api/v1/charges"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Idempotency-Key"] = "bench-replay-1"
wrk.body = '{"amount":100,"currency":"usd","customer":"cus_1"}'
