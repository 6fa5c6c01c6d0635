-- A minimal RESP (Redis protocol) client over an ngx cosocket, for the
-- OpenResty-style peer in the benchmark: connect with keepalive reuse,
-- send one command, read one reply.
local resp = {}

local function encode(args)
  local out = { "*", #args, "\r\n" }
  for _, a in ipairs(args) do
    a = tostring(a)
    out[#out + 1] = "$"
    out[#out + 1] = #a
    out[#out + 1] = "\r\n"
    out[#out + 1] = a
    out[#out + 1] = "\r\n"
  end
  return table.concat(out)
end

local function read_reply(sock)
  local line, err = sock:receive("*l")
  if not line then return nil, err end
  local kind, rest = line:sub(1, 1), line:sub(2)
  if kind == "+" then return rest end
  if kind == "-" then return nil, rest end
  if kind == ":" then return tonumber(rest) end
  if kind == "$" then
    local n = tonumber(rest)
    if n < 0 then return ngx.null end
    local data, e = sock:receive(n + 2)
    if not data then return nil, e end
    return data:sub(1, n)
  end
  if kind == "*" then
    local n = tonumber(rest)
    if n < 0 then return ngx.null end
    local items = {}
    for i = 1, n do
      local v, e = read_reply(sock)
      if v == nil then return nil, e end
      items[i] = v
    end
    return items
  end
  return nil, "bad reply: " .. line
end

-- Sends one command on a pooled connection; returns reply or nil, err.
function resp.call(host, port, args)
  local sock = ngx.socket.tcp()
  sock:settimeouts(100, 100, 100)
  local ok, err = sock:connect(host, port)
  if not ok then return nil, err end
  local _, e = sock:send(encode(args))
  if e then sock:close() return nil, e end
  local reply, rerr = read_reply(sock)
  if reply == nil and rerr and not rerr:find("^NOSCRIPT") and not rerr:find("^ERR") then
    sock:close()
    return nil, rerr
  end
  sock:setkeepalive(10000, 64)
  return reply, rerr
end
-- Scripts' SHA-1s, as EVALSHA names them.
local shas = {}

-- Decides a request by `script` (EVALSHA, loaded once when the server
-- lacks it) with `keys` and `argv`, on BENCH_REDIS_PORT: returns when it
-- answered 1; otherwise the request ends with 429, or 503 when Redis
-- failed.
function resp.decide(script, keys, argv)
  local port = tonumber(os.getenv("BENCH_REDIS_PORT") or "6379")
  local sha = shas[script]
  if not sha then
    sha = (ngx.sha1_bin(script):gsub(".", function(c) return string.format("%02x", string.byte(c)) end))
    shas[script] = sha
  end
  local args = { "EVALSHA", sha, #keys }
  for _, k in ipairs(keys) do args[#args + 1] = k end
  for _, a in ipairs(argv) do args[#args + 1] = a end
  local reply, err = resp.call("127.0.0.1", port, args)
  if reply == nil and err and err:find("^NOSCRIPT") then
    resp.call("127.0.0.1", port, { "SCRIPT", "LOAD", script })
    reply, err = resp.call("127.0.0.1", port, args)
  end
  if reply == nil then
    ngx.log(ngx.ERR, "redis: ", err)
    return ngx.exit(503)
  end
  if reply ~= 1 then return ngx.exit(429) end
end

return resp
