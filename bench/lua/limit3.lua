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
local host, port = "127.0.0.1", tonumber(os.getenv("BENCH_REDIS_PORT") or "6379")
local sha
-- Credentials by the digest of their key.
local credentials = {}

local function hex(bin)
  return (bin:gsub(".", function(c) return string.format("%02x", string.byte(c)) end))
end

function M.init(key)
  credentials[ngx.sha1_bin("Bearer " .. key)] = { id = "bench", tenant = "bench-tenant" }
end

function M.check()
  local credential = credentials[ngx.sha1_bin(ngx.var.http_authorization or "")]
  if not credential then return ngx.exit(401) end
  sha = sha or hex(ngx.sha1_bin(SCRIPT))
  local args = { "EVALSHA", sha, 3, "rl3:c:" .. credential.id, "rl3:t:" .. credential.tenant, "rl3:g",
                 1000000000, 1000000000, 1 }
  local reply, err = resp.call(host, port, args)
  if reply == nil and err and err:find("^NOSCRIPT") then
    resp.call(host, port, { "SCRIPT", "LOAD", SCRIPT })
    reply, err = resp.call(host, port, args)
  end
  if reply == nil then
    ngx.log(ngx.ERR, "redis: ", err)
    return ngx.exit(503)
  end
  if reply ~= 1 then return ngx.exit(429) end
  ngx.req.set_header("X-Tenant-Id", credential.tenant)
  ngx.req.set_header("X-Credential-Id", credential.id)
end

return M
