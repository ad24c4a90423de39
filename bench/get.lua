-- A GET, which no route protects: the proxy only forwards it (no key, no store, no lock).
-- Beside nginx forwarding the same GET, it is the ceiling of any protected workload here:
-- what hyper's server and client cost before the proxy does any work of its own.
wrk.method = "GET"
wrk.path = "/api/v1/charges"
