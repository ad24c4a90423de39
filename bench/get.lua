-- A GET, which no route protects: the proxy only forwards it (no key, no store, no lock).
-- Beside nginx forwarding the same GET, it is the ceiling of any protected workload here:
-- what hyper's server and client cost before the proxy does any work of its own.
wrk.method = "GET"
wrk.path = "/api/v1/charges"

-- The tail, beside wrk's own percentiles (which stop at the 99th): bench/run.sh reads these.
function done(summary, latency, requests)
  for _, p in ipairs({50, 99, 99.9}) do
    io.write(string.format("P%s %.3fms\n", p, latency:percentile(p) / 1000))
  end
end
