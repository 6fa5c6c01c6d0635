-- serve.lua: the end of every script, and of the function library.
--
-- Loaded as a function library (FUNCTION LOAD, Redis >= 7), each concern
-- is a function of its own, PREFIX and its name: the helpers are made
-- once, and a call runs only its concern. (No library, not even `pairs`,
-- is reachable while a library loads.) Run as a script (EVALSHA), the
-- whole text runs on every call, and CONCERN names the handler that
-- answers it.
if redis.register_function then
  local function serve(concern)
    local handle = HANDLERS[concern]
    redis.register_function(PREFIX .. concern, function(call_keys, args)
      return run(call_keys, args, handle)
    end)
  end
  serve('decide')
  serve('settle')
  serve('inspect')
else
  return run(KEYS, ARGV, HANDLERS[CONCERN])
end
