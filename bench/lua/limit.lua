-- The OpenResty-style peer: one Redis token-bucket script per request
-- (the shape of Kong's and APISIX's Redis rate-limiting policies), keyed by
-- the API key, before proxy_pass.
local resp = require("resp")

local SCRIPT = [[
local key = KEYS[1]
local capacity = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local t = redis.call("TIME")
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local s = redis.call("HMGET", key, "tokens", "ts")
local tokens = tonumber(s[1]) or capacity
local ts = tonumber(s[2]) or now
tokens = math.min(capacity, tokens + math.max(0, now - ts) * rate)
local allowed = 0
if tokens >= cost then tokens = tokens - cost allowed = 1 end
redis.call("HSET", key, "tokens", tokens, "ts", math.max(now, ts))
redis.call("EXPIRE", key, math.ceil(capacity / rate) + 1)
return allowed
]]

local M = {}

function M.check()
  local key = "rl:" .. (ngx.var.http_authorization or "anonymous")
  return resp.decide(SCRIPT, { key }, { 1000000000, 1000000000, 1 })
end

return M
