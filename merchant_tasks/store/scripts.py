"""The token store's Lua scripts, sent as ``keys.Command`` values by the store, the exchange
rate and the reading of many accounts (``token_store``, ``exchange_rate``, ``reading``).

Each script reads a corrupt or wrong-typed value as absent and writes over it: a key
holding garbage (a hash where a string belongs, JSON that is not a token, a counter that
is not a number) never fails a script, and the next write replaces it (docs/reliability.md,
"Corrupt values"). The renewal lock is taken here too, one way (``take_lock``): free, or
held by a process whose owner prefix is the caller's (a lock command that ran late, after
its caller gave up, still names that process), or a value without a TTL (no holder ever
writes one).
"""

from __future__ import annotations

# Helpers every script starts with. ``redis.pcall`` returns an error as a table instead of
# raising: a wrong-typed key reads as absent. ``observe`` adds a duration (microseconds) to
# a histogram whose field names are ARGV from ``first`` on (``token_store.Histogram``).
_HELPERS = """
local function read_string(key)
  local raw = redis.pcall('GET', key)
  if type(raw) ~= 'string' then return nil end
  return raw
end
local function read_number(key)
  local raw = read_string(key)
  return raw and tonumber(raw)
end
local function token_generation(raw)
  if not raw then return nil end
  local ok, doc = pcall(cjson.decode, raw)
  if not ok or type(doc) ~= 'table' then return nil end
  return tonumber(doc['generation'])
end
-- A token record with its top-level field ``name`` set to ``text`` (a JSON number or
-- boolean), edited in place so that every other byte stays as Python wrote it (cjson
-- would round the times to 14 digits). A string value escapes its quotes, so ',"name":'
-- only matches a field; a record written before the field existed gets it appended.
local function set_field(raw, name, text)
  local field = ',"' .. name .. '":'
  local edited, found = string.gsub(raw, field .. '[^,}]*', field .. text, 1)
  if found == 1 then return edited end
  return string.sub(raw, 1, -2) .. field .. text .. '}'
end
local function field_of(raw, name)
  return string.match(raw, ',"' .. name .. '":([^,}]*)')
end
-- A record's string field (``retry_route``, ``routes``: their text never holds a quote or a
-- backslash, ``token.Token.to_json``), read and written in place like ``set_field``.
local function text_of(raw, name)
  return string.match(raw, ',"' .. name .. '":"([^"]*)"') or ''
end
local function set_text(raw, name, text)
  local field = ',"' .. name .. '":"'
  local start, stop = string.find(raw, field, 1, true)
  if start then
    local close = string.find(raw, '"', stop + 1, true)
    return string.sub(raw, 1, stop) .. text .. string.sub(raw, close)
  end
  return string.sub(raw, 1, -2) .. field .. text .. '"}'
end
-- ``routes`` (``route=until`` separated by blanks) without ``route``'s entry
local function without_route(routes, route)
  local kept = {}
  for entry in string.gmatch(routes, '%S+') do
    if string.sub(entry, 1, #route + 1) ~= route .. '=' then table.insert(kept, entry) end
  end
  return table.concat(kept, ' ')
end
-- whether ``text`` (words separated by blanks) lists ``word``, and how many it lists
local function lists(text, word)
  for entry in string.gmatch(text, '%S+') do
    if entry == word then return true end
  end
  return false
end
local function count_words(text)
  return select(2, string.gsub(text, '%S+', ''))
end
-- whether the record names ``route`` (its retry route, or one of its routes)
local function names_route(raw, route)
  if route == '' then return false end
  if text_of(raw, 'retry_route') == route then return true end
  return without_route(text_of(raw, 'routes'), route) ~= text_of(raw, 'routes')
end
local function rewrite_token(key, raw)
  redis.call('SET', key, raw, 'KEEPTTL')
end
local function fit(key, kind)
  local found = redis.call('TYPE', key)['ok']
  if found ~= 'none' and found ~= kind then redis.call('DEL', key) end
end
local function incr(hash, field, by)
  fit(hash, 'hash')
  local reply = redis.pcall('HINCRBY', hash, field, by)
  if type(reply) == 'table' and reply['err'] then redis.call('HSET', hash, field, by) end
end
local function take_lock(key, value, prefix, lease_ms)
  if value == '' then return false end
  local held = redis.pcall('GET', key)
  if type(held) == 'string' and redis.call('PTTL', key) ~= -1
      and string.sub(held, 1, #prefix) ~= prefix then
    return false
  end
  redis.call('SET', key, value, 'PX', lease_ms)
  return true
end
local function observe(hash, micros, first)
  local field = ARGV[first + 1]
  for i = first + 2, #ARGV, 2 do
    if micros <= tonumber(ARGV[i]) then field = ARGV[i + 1]; break end
  end
  incr(hash, field, 1)
  incr(hash, ARGV[first], micros)
end
local function note_wait(counters, counter, waits, limit_ms)
  incr(counters, counter, 1)
  fit(waits, 'list')
  local now = redis.call('TIME')
  redis.call('RPUSH', waits, now[1] .. string.format('%06d', tonumber(now[2])) .. ':' .. limit_ms)
  redis.call('LTRIM', waits, -1000, -1)
  redis.call('PEXPIRE', waits, limit_ms)
end
"""

# KEYS: token, generation, waits, histograms, issuer. ARGV: expected generation, token JSON,
# kept until (Redis seconds), the highest generation the writer saw stored, the issuing
# token endpoint's fingerprint (kept in ``issuer``: evidence that the endpoint issues this
# account's tokens, docs/design.md "Refusals"), then the lock-wait histogram's
# ``Histogram.script_args``.
# Returns {1, new generation, then each wait it recorded (microseconds)} when written,
# {0, current generation} when another write came first, {-1, expected generation} when
# the token has already expired. A stored
# generation below the expected one is accepted only when the writer saw the expected one
# stored: Redis lost writes (a failover, a restart without persistence), and the token is
# written above them. A write ends the noted waits: each one that has not outlasted its
# limit goes into the histogram, from its start to now, so a waiter sends nothing more.
SAVE_IF_GENERATION = (
    _HELPERS
    + """
-- the token's own generation counts too: an evicted generation key must not let a write
-- reuse the stored token's generation (no process would see it replace the stored one)
local current = math.max(read_number(KEYS[2]) or 0, token_generation(read_string(KEYS[1])) or 0)
local expected = tonumber(ARGV[1])
if current ~= expected and not (current < expected and expected <= tonumber(ARGV[4])) then
  return {0, current}
end
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local ttl_ms = math.floor(tonumber(ARGV[3]) * 1000) - now_ms
if ttl_ms <= 0 then return {-1, expected} end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ttl_ms)
redis.call('SET', KEYS[2], expected + 1)
if ARGV[5] ~= '' then redis.call('SET', KEYS[5], ARGV[5]) end
fit(KEYS[3], 'list')
local waits = redis.call('LRANGE', KEYS[3], 0, -1)
local reply = {1, expected + 1}
if #waits > 0 then
  redis.call('DEL', KEYS[3])
  local now_us = tonumber(now[1]) * 1000000 + tonumber(now[2])
  for _, wait in ipairs(waits) do
    local since, limit_ms = string.match(wait, '^(%d+):(%d+)$')
    local waited = since and now_us - tonumber(since)
    if waited and waited >= 0 and waited <= tonumber(limit_ms) * 1000 then
      observe(KEYS[4], waited, 6)
      table.insert(reply, waited)
    end
  end
end
return reply
"""
)

# KEYS: token, counters, waits. ARGV: the generation the caller found stale, the lock-wait
# counter, the wait's limit (ms). Notes the wait unless a token of a newer generation is
# stored (the renewal ended before this caller could wait for it): 1 noted, 0 not. With no
# token stored (a new process, an expired token) the wait is noted whatever it last saw.
NOTE_WAIT_UNLESS_RENEWED = (
    _HELPERS
    + """
local generation = token_generation(read_string(KEYS[1]))
if generation and generation > tonumber(ARGV[1]) then return 0 end
note_wait(KEYS[2], ARGV[2], KEYS[3], ARGV[3])
return 1
"""
)

# KEYS: accepted, token. ARGV: generation, the route accepted ('' : none named), how many
# routes a record lists. Marks the token record accepted when it is of that generation (the
# evidence lives with the token), lists the route among those that accepted it, and clears
# what the route's success answers: the record's retry route, if it is this one, and its
# judgment of this route. Raises the ``accepted`` key (read by releases before this one).
# Writes only what changes. Returns the token record as it is now when it is of that
# generation (the evidence the caller just gave, and any other), else nil.
RAISE_ACCEPTED = (
    _HELPERS
    + """
local raw = read_string(KEYS[2])
if raw and token_generation(raw) == tonumber(ARGV[1]) then
  local edited = raw
  if field_of(raw, 'accepted') ~= 'true' then edited = set_field(edited, 'accepted', 'true') end
  local accepted_routes = text_of(edited, 'accepted_routes')
  if ARGV[2] ~= '' and not lists(accepted_routes, ARGV[2])
      and count_words(accepted_routes) < tonumber(ARGV[3]) then
    local listed = ARGV[2]
    if accepted_routes ~= '' then listed = accepted_routes .. ' ' .. ARGV[2] end
    edited = set_text(edited, 'accepted_routes', listed)
  end
  if ARGV[2] ~= '' and text_of(edited, 'retry_route') == ARGV[2] then
    edited = set_text(edited, 'retry_route', '')
  end
  local routes = text_of(edited, 'routes')
  if ARGV[2] ~= '' and without_route(routes, ARGV[2]) ~= routes then
    edited = set_text(edited, 'routes', without_route(routes, ARGV[2]))
  end
  if edited ~= raw then rewrite_token(KEYS[2], edited) end
  raw = edited
else
  raw = false
end
if tonumber(ARGV[1]) > (read_number(KEYS[1]) or 0) then redis.call('SET', KEYS[1], ARGV[1]) end
return raw
"""
)

# KEYS: token. ARGV: generation, route, until (Redis seconds; 0: the route lacks a
# permission). Records the judgment of a 401 on the route in the token's record, if it is
# of that generation. Returns the record as it is now (nil: none stored).
JUDGE_ROUTE = (
    _HELPERS
    + """
local raw = read_string(KEYS[1])
if raw and token_generation(raw) == tonumber(ARGV[1]) then
  local routes = without_route(text_of(raw, 'routes'), ARGV[2])
  local entry = ARGV[2] .. '=' .. ARGV[3]
  if routes ~= '' then entry = routes .. ' ' .. entry end
  raw = set_text(raw, 'routes', entry)
  rewrite_token(KEYS[1], raw)
end
return raw or false
"""
)

# KEYS: token, lock, counters, waits. ARGV: refused generation, the lock value to take it
# with ('' : do not take it, a thread of this process holds it), the process's owner
# prefix, lease (ms), the 401 counter ('' : no new 401, do not count), the lock-wait
# counter, the wait's limit (ms), the route of the 401 ('' : none), '1' to mark the record
# refused, '1' if the route was judged already. Counts the 401 and reads the token. When
# the stored token is the refused one and its record names the route (its retry route, or
# one of its routes) not judged yet, nothing else is done: what that 401 means is judged
# from the record first (``renewal.life``). Otherwise the 401 marks its record refused
# (Redis time and the route, the first refusal kept): from then on no process sends it,
# and whichever process replaces it knows the route; and when it is the refused one (or
# none is stored), tries the renewal lock, and notes the wait if another holds it.
# Returns {token JSON or nil, 1: lock taken, 0: not tried, -1: held by another (noted),
# 2: the record names the route}.
LOOK_AFTER_401 = (
    _HELPERS
    + """
if ARGV[5] ~= '' then incr(KEYS[3], ARGV[5], 1) end
local raw = read_string(KEYS[1])
local generation = token_generation(raw)
if generation and generation ~= tonumber(ARGV[1]) then return {raw or false, 0} end
if generation and ARGV[10] ~= '1' and names_route(raw, ARGV[8]) then return {raw, 2} end
if generation and ARGV[9] == '1' and (tonumber(field_of(raw, 'refused_at')) or 0) == 0 then
  local now = redis.call('TIME')
  raw = set_field(raw, 'refused_at', now[1] .. '.' .. string.format('%06d', tonumber(now[2])))
  if ARGV[8] ~= '' then raw = set_text(raw, 'refused_route', ARGV[8]) end
  rewrite_token(KEYS[1], raw)
end
if take_lock(KEYS[2], ARGV[2], ARGV[3], ARGV[4]) then return {raw or false, 1} end
note_wait(KEYS[3], ARGV[6], KEYS[4], ARGV[7])
return {raw or false, -1}
"""
)

# KEYS: lock. ARGV: value, owner prefix, lease (ms). 1 if taken (see ``take_lock``).
TAKE_LOCK = (
    _HELPERS
    + """
if take_lock(KEYS[1], ARGV[1], ARGV[2], ARGV[3]) then return 1 end
return 0
"""
)

# KEYS: lock. ARGV: value, lease (ms). Extends the lease if the lock is still this holding's.
EXTEND_LOCK = """
if redis.pcall('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

# KEYS: lock. ARGV: value. Deletes the lock only if it is still this holding's.
RELEASE_LOCK = """
if redis.pcall('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: a hash of counters, the exchange log. ARGV: a log entry ('' : none), its time,
# the log's horizon (older entries are dropped), then pairs of (field, increment).
COUNT = (
    _HELPERS
    + """
for i = 4, #ARGV, 2 do incr(KEYS[1], ARGV[i], tonumber(ARGV[i + 1])) end
if ARGV[1] ~= '' then
  fit(KEYS[2], 'zset')
  redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[3])
end
return 1
"""
)

# KEYS: histograms. ARGV: a duration (microseconds), then the histogram's
# ``Histogram.script_args``.
OBSERVE = (
    _HELPERS
    + """
observe(KEYS[1], tonumber(ARGV[1]), 2)
return 1
"""
)

# KEYS: a sorted set of times. ARGV: oldest time kept, then a time to add (or '').
# Drops older entries, adds the time, returns how many are left before adding it.
COUNT_RECENT = (
    _HELPERS
    + """
fit(KEYS[1], 'zset')
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[1])
local count = redis.call('ZCARD', KEYS[1])
if ARGV[2] ~= '' then redis.call('ZADD', KEYS[1], ARGV[2], ARGV[2]) end
return count
"""
)

# KEYS: the forced renewals' reservations (a sorted set, seconds). ARGV: the interval (ms),
# the burst tolerance (ms), how long reservations are kept (ms). Reserves the next forced
# renewal by the generic cell rate algorithm: each reservation is kept at its theoretical
# time (the latest one's is where the allowance stands), a renewal may go at once while
# that is no more than the burst tolerance ahead of now, else at that time less the
# tolerance. Returns how long (ms) its renewer waits. The latest time is found by bisection
# with ZCOUNT: the README's least-privilege ACL user has ZCOUNT, not ZRANGE or ZSCORE.
SPACE_FORCED = (
    _HELPERS
    + """
fit(KEYS[1], 'zset')
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local interval, tolerance = tonumber(ARGV[1]), tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. ((now_ms - tonumber(ARGV[3])) / 1000))
local function later_than(ms)
  return redis.call('ZCOUNT', KEYS[1], '(' .. (ms / 1000), '+inf') > 0
end
local due = now_ms  -- the allowance's theoretical time
if later_than(now_ms) then
  local low, high = now_ms, now_ms + interval
  while later_than(high) do low, high = high, high + (high - low) * 2 end
  while high - low > 1 do  -- the latest time is in (low, high]
    local middle = math.floor((low + high) / 2)
    if later_than(middle) then low = middle else high = middle end
  end
  due = high
end
local at = math.max(now_ms, due - tolerance)
local seconds = string.format('%.3f', (math.max(due, now_ms) + interval) / 1000)
redis.call('ZADD', KEYS[1], seconds, seconds)
return at - now_ms
"""
)

# KEYS: a slot key. ARGV: its lifetime (ms). SET NX, over a value no slot writer leaves
# without a TTL (garbage would hold the slot for ever).
TAKE_SLOT = """
if redis.call('PTTL', KEYS[1]) == -1 then redis.call('DEL', KEYS[1]) end
if redis.call('SET', KEYS[1], '1', 'NX', 'PX', ARGV[1]) then return 1 end
return 0
"""

# KEYS: one token endpoint host's exchange rate (a hash). ARGV: what for ('caller',
# 'background', 'cut' after a 429, 'peek'), the cap (per second), the bucket's size in
# seconds of the rate, the permits kept for callers, the hold after a halving (ms), the
# step of the increase (a share of the cap), the step's interval (ms), the lowest rate,
# the spacing of halvings (ms), the longest wait the asker accepts (ms), how long it has
# waited so far (ms), the key's lifetime (ms).
# A token bucket in Redis time. A caller reserves the next permit, the bucket going into
# debt, and is told how long to wait for it (no polling); beat's renewals take one only
# while RESERVED permits stay for callers, else they are told when to ask again. The rate
# is the cap until a 429 halves it (at most once per spacing, down to the lowest rate);
# after the hold it grows back by one step per interval.
# Only commands the README's ACL user has (HGETALL, HSET, HINCRBY, PEXPIRE, TIME, TYPE, DEL).
# Returns {1 granted (wait ms before sending) / 0 ask again after ms / -1 no permit within
# the asker's wait, wait ms, rate, permits in the bucket}.
TAKE_EXCHANGE_PERMIT = (
    _HELPERS
    + """
local key, mode, cap = KEYS[1], ARGV[1], tonumber(ARGV[2])
fit(key, 'hash')
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local fields, state = redis.call('HGETALL', key), {}
for i = 1, #fields, 2 do state[fields[i]] = fields[i + 1] end
local cut_rate, cut_at = tonumber(state['cut_rate']), tonumber(state['cut_at'])
local rate = cap
if cut_rate and cut_at then
  local grown = now_ms - cut_at - tonumber(ARGV[5])
  rate = cut_rate
  if grown >= 0 then
    rate = cut_rate + cap * tonumber(ARGV[6]) * (math.floor(grown / tonumber(ARGV[7])) + 1)
  end
  rate = math.min(rate, cap)
end
local reserved = tonumber(ARGV[4])
local size = math.max(reserved + 1, rate * tonumber(ARGV[3]))
local tokens, at = tonumber(state['tokens']), tonumber(state['at'])
if not tokens or not at then tokens, at = size, now_ms end
tokens = math.min(size, tokens + math.max(0, now_ms - at) * rate / 1000)
if mode == 'peek' then return {1, 0, tostring(rate), tostring(tokens)} end
local result, wait_ms = 1, 0
local budget_ms, waited_ms = tonumber(ARGV[10]), tonumber(ARGV[11])
if mode == 'cut' then
  if not cut_at or now_ms - cut_at >= tonumber(ARGV[9]) then
    rate = math.max(math.min(tonumber(ARGV[8]), cap), rate / 2)
    redis.call('HSET', key, 'cut_rate', tostring(rate), 'cut_at', now_ms)
    incr(key, 'cuts', 1)
    tokens = math.min(tokens, math.max(reserved + 1, rate * tonumber(ARGV[3])))
  end
elseif mode == 'caller' then
  wait_ms = math.max(0, math.ceil((1 - tokens) * 1000 / rate))
  if wait_ms > budget_ms then
    result = -1
  else
    tokens = tokens - 1
    incr(key, 'granted_caller', 1)
  end
else
  local need = reserved + 1
  if tokens >= need then
    tokens = tokens - 1
    incr(key, 'granted_background', 1)
  else
    wait_ms = math.ceil((need - tokens) * 1000 / rate)
    result = 0
    if wait_ms > budget_ms then result = -1 end
  end
end
if result == -1 then incr(key, 'gave_up', 1) end
if result == 1 and mode ~= 'cut' and wait_ms + waited_ms > 0 then
  incr(key, 'waited', 1)
  incr(key, 'waited_ms', wait_ms + waited_ms)
end
if rate >= cap and cut_at then redis.call('HSET', key, 'cut_rate', '', 'cut_at', '') end
redis.call('HSET', key, 'tokens', string.format('%.6f', tokens), 'at', now_ms)
redis.call('PEXPIRE', key, ARGV[12])
return {result, wait_ms, tostring(rate), tostring(tokens)}
"""
)

# KEYS: string keys (beat's due check reads up to MGET_CHUNK at once). The value of each,
# nil for one absent or of the wrong type. MGET would do, but the least-privilege ACL
# user documented in the README has EVAL and GET, not MGET.
READ_STRINGS = """
local values = {}
for i, key in ipairs(KEYS) do
  local raw = redis.pcall('GET', key)
  values[i] = type(raw) == 'string' and raw or false
end
return values
"""

# KEYS: per account, in this order, its token, breaker, lock, counters, histograms and
# exchange log (``store.reading``: up to READ_BATCH accounts a script);
# ARGV: the starts of the windows whose exchanges are counted. One JSON array, an array per
# account: the three strings (false: absent), the two hashes as flat arrays of fields and
# values (``{}`` when empty: cjson's empty table), then each window's count; a command's
# error as ``{"err": ...}``, read in Python as the same command's error would be. JSON,
# because one string of 10,000 accounts parses at C speed where nested replies would not;
# cjson copies a string's bytes as they are, so a value that is not UTF-8 stays its bytes.
READ_ACCOUNTS = """
local function read(...)
  local reply = redis.pcall(...)
  if type(reply) == 'table' and reply.err then return {err = reply.err} end
  return reply
end
local accounts = {}
for i = 1, #KEYS, 6 do
  local row = {
    read('GET', KEYS[i]), read('GET', KEYS[i + 1]), read('GET', KEYS[i + 2]),
    read('HGETALL', KEYS[i + 3]), read('HGETALL', KEYS[i + 4]),
  }
  for _, since in ipairs(ARGV) do row[#row + 1] = read('ZCOUNT', KEYS[i + 5], since, '+inf') end
  accounts[#accounts + 1] = row
end
return cjson.encode(accounts)
"""
