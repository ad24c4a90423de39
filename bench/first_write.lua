-- Every request a new idempotency key: each one is a durable first write (reserve, forward,
-- store), never a replay. The request is built once per thread (wrk.format) and only the key
-- and the customer change per request, by concatenation: wrk shares the cores with what it
-- measures, and building each request with wrk.format cost it ~2 µs more per request than a
-- static one.
local counter = 0
local threads = {}

function setup(thread)
  thread:set("id", #threads + 1)
  table.insert(threads, thread)
end

function init(args)
  local prefix = string.format("bench-%d-%d-", os.time(), id)
  -- "@CUS" is as long as the four digits that replace it: Content-Length stays right.
  local template = wrk.format("POST", "/api/v1/charges", {
    ["Content-Type"] = "application/json",
    ["Idempotency-Key"] = prefix .. "@KEY@",
  }, '{"amount":100,"currency":"usd","customer":"cus_@CUS"}')
  head, middle, tail = template:match("^(.-)@KEY@(.-)@CUS(.*)$")
end

function request()
  counter = counter + 1
  return head .. counter .. middle .. string.format("%04d", counter % 1000) .. tail
end

-- The tail, beside wrk's own percentiles (which stop at the 99th): bench/run.sh reads these.
function done(summary, latency, requests)
  for _, p in ipairs({50, 99, 99.9}) do
    io.write(string.format("P%s %.3fms\n", p, latency:percentile(p) / 1000))
  end
end
