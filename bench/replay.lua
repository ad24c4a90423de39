-- Every request carries the same key and body: after the first, all are replays.
wrk.method = "POST"
wrk.path = "/api/v1/charges"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Idempotency-Key"] = "bench-replay-1"
wrk.body = '{"amount":100,"currency":"usd","customer":"cus_1"}'

-- The tail, beside wrk's own percentiles (which stop at the 99th): bench/run.sh reads these.
function done(summary, latency, requests)
  for _, p in ipairs({50, 99, 99.9}) do
    io.write(string.format("P%s %.3fms\n", p, latency:percentile(p) / 1000))
  end
end
