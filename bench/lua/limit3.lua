-- The equal-work peer: what tollgate's full path does, in NGINX + Lua.
-- The API key is looked up in a table (by its SHA-1, computed in C by
-- NGINX: the peer's stand-in for tollgate's SHA-256 digest), then three
-- token buckets (per credential, per tenant, global) are decided all or
-- nothing in one Redis script call per request, before proxy_pass.
local resp = require("resp")

local SCRIPT = [[
local cap, rate, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local t = redis.call("TIME")
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local tokens, ok = {}, 1
for i = 1, #KEYS do
  local s = redis.call("HMGET", KEYS[i], "tokens", "ts")
  local tk = tonumber(s[1]) or cap
  local ts = tonumber(s[2]) or now
  tk = math.min(cap, tk + math.max(0, now - ts) * rate)
  tokens[i] = tk
  if tk < cost then ok = 0 end
end
for i = 1, #KEYS do
  local tk = tokens[i]
  if ok == 1 then tk = tk - cost end
  redis.call("HSET", KEYS[i], "tokens", tk, "ts", now)
  redis.call("EXPIRE", KEYS[i], math.ceil(cap / rate) + 1)
end
return ok
]]

local M = {}
-- Credentials by the digest of their key.
local credentials = {}

function M.init(key)
  credentials[ngx.sha1_bin("Bearer " .. key)] = { id = "bench", tenant = "bench-tenant" }
end

function M.check()
  local credential = credentials[ngx.sha1_bin(ngx.var.http_authorization or "")]
  if not credential then return ngx.exit(401) end
  resp.decide(SCRIPT, { "rl3:c:" .. credential.id, "rl3:t:" .. credential.tenant, "rl3:g" },
              { 1000000000, 1000000000, 1 })
  ngx.req.set_header("X-Tenant-Id", credential.tenant)
  ngx.req.set_header("X-Credential-Id", credential.id)
end

return M
