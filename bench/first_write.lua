-- Every request a new idempotency key: each one is a durable first write (reserve, forward,
-- store), never a replay.
local counter = 0
local threads = {}

function setup(thread)
  thread:set("id", #threads + 1)
  table.insert(threads, thread)
end

function init(args)
  prefix = string.format("bench-%d-%d-", os.time(), id)
end

function request()
  counter = counter + 1
  return wrk.format("POST", "/api/v1/charges", {
    ["Content-Type"] = "application/json",
    ["Idempotency-Key"] = prefix .. counter,
  }, '{"amount":100,"currency":"usd","customer":"cus_' .. (counter % 1000) .. '"}')
end
