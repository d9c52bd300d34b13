package redisstore

import "github.com/redis/go-redis/v9"

// Every script touches one Redis Cluster slot: KEYS[1] and every key the script builds share the
// hash tag of one shard ("{N}"), so a script never crosses slots and needs no cross-slot flag.
//
// A binding is a string "<expiry ms>:<engine ID>" at the binding key, with a Redis TTL that ends
// at the expiry plus Options.TTLSlack (garbage collection; the logical expiry in the value, judged
// against the caller's clock, is what decides). Each engine has one sorted set per shard, the engine's reverse index
// in that shard: member = binding key, score = expiry ms. Expired members are pruned when the
// engine gains a binding in that shard, and the whole set expires with its latest binding.
//
// Lua numbers are doubles: millisecond times stay exact below 2^53 (year 287,396).

// scriptLookup: KEYS[1] binding key. ARGV[1] now ms, ARGV[2] idle ms, ARGV[3] reverse-set key
// prefix of the shard, ARGV[4] TTL slack ms. Returns the bound engine ID, refreshed, or nil for no
// live binding.
var scriptLookup = redis.NewScript(`
local v = redis.call('GET', KEYS[1])
if not v then return false end
local i = string.find(v, ':', 1, true)
local exp = tonumber(string.sub(v, 1, i - 1))
local eng = string.sub(v, i + 1)
local now = tonumber(ARGV[1])
if now >= exp then
  redis.call('DEL', KEYS[1])
  redis.call('ZREM', ARGV[3] .. eng, KEYS[1])
  return false
end
local nexp = now + tonumber(ARGV[2])
if nexp > exp then
  local ttl = nexp - now + tonumber(ARGV[4])
  redis.call('SET', KEYS[1], string.format('%d', nexp) .. ':' .. eng, 'PX', ttl)
  local rev = ARGV[3] .. eng
  redis.call('ZADD', rev, nexp, KEYS[1])
  if redis.call('PTTL', rev) < ttl then redis.call('PEXPIRE', rev, ttl) end
end
return eng
`)

// scriptSet: first bind (ARGV[5] = "0") or replace of the expected engine ARGV[6] (ARGV[5] =
// "1"). KEYS[1] binding key. ARGV[1] now ms, ARGV[2] idle ms, ARGV[3] reverse-set key prefix,
// ARGV[4] engine to bind, ARGV[7] TTL slack ms. A live binding that is not replaceable wins and is
// refreshed. Returns the scope's engine after the call.
var scriptSet = redis.NewScript(`
local now = tonumber(ARGV[1])
local idle = tonumber(ARGV[2])
local slack = tonumber(ARGV[7])
local v = redis.call('GET', KEYS[1])
if v then
  local i = string.find(v, ':', 1, true)
  local exp = tonumber(string.sub(v, 1, i - 1))
  local eng = string.sub(v, i + 1)
  if now < exp and (ARGV[5] == '0' or eng ~= ARGV[6]) then
    local nexp = now + idle
    if nexp > exp then
      local ttl = nexp - now + slack
      redis.call('SET', KEYS[1], string.format('%d', nexp) .. ':' .. eng, 'PX', ttl)
      local rev = ARGV[3] .. eng
      redis.call('ZADD', rev, nexp, KEYS[1])
      if redis.call('PTTL', rev) < ttl then redis.call('PEXPIRE', rev, ttl) end
    end
    return eng
  end
  redis.call('ZREM', ARGV[3] .. eng, KEYS[1])
end
local nexp = now + idle
redis.call('SET', KEYS[1], string.format('%d', nexp) .. ':' .. ARGV[4], 'PX', idle + slack)
local rev = ARGV[3] .. ARGV[4]
redis.call('ZREMRANGEBYSCORE', rev, '-inf', now)
redis.call('ZADD', rev, nexp, KEYS[1])
if redis.call('PTTL', rev) < idle + slack then redis.call('PEXPIRE', rev, idle + slack) end
return ARGV[4]
`)

// scriptInvalidate: KEYS[1] the engine's reverse set in one shard. ARGV[1] engine ID, ARGV[2]
// now ms. Deletes every binding in the set that still names the engine and the set itself;
// returns how many of the deleted bindings were live.
var scriptInvalidate = redis.NewScript(`
local members = redis.call('ZRANGE', KEYS[1], 0, -1)
local now = tonumber(ARGV[2])
local live = 0
for _, k in ipairs(members) do
  local v = redis.call('GET', k)
  if v then
    local i = string.find(v, ':', 1, true)
    if string.sub(v, i + 1) == ARGV[1] then
      if tonumber(string.sub(v, 1, i - 1)) > now then live = live + 1 end
      redis.call('DEL', k)
    end
  end
end
redis.call('DEL', KEYS[1])
return live
`)
