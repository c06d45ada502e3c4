"""Reading the request lanes without blocking: every lane, most urgent first, in ONE round trip.

A lane is read only once the more urgent ones are empty, and no more entries are taken than
the group has room for (what is not taken stays in the stream for other groups). Doing that
with one XREADGROUP per lane costs a round trip per lane on every scheduler step; this Lua
script does the same reads inside Redis. Its reply is XREADGROUP's, lane by lane.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from shared.bus import pairs_to_fields

# KEYS: the lanes, most urgent first. ARGV: consumer group, consumer, room (entries at most).
READ_LANES = """
local room = tonumber(ARGV[3])
local out = {}
for _, lane in ipairs(KEYS) do
  if room <= 0 then break end
  local got = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', room,
                         'STREAMS', lane, '>')
  if got then
    out[#out + 1] = got[1]
    room = room - #got[1][2]
  end
end
return out
"""

Entry = tuple[str, bytes, dict[bytes, bytes]]  # (lane, entry id, fields)


class LaneReader:
    def __init__(self, redis: aioredis.Redis, lanes: list[str], group: str, consumer: str):
        self.lanes = lanes  # most urgent first
        self.group = group  # the schedulers' consumer group
        self.consumer = consumer  # this scheduler's name in it
        self._script = redis.register_script(READ_LANES)

    async def read(self, room: int) -> list[Entry]:
        """Up to `room` new entries, the most urgent lanes' first; [] when all are empty."""
        reply = await self._script(keys=self.lanes, args=[self.group, self.consumer, room])
        return [
            (lane.decode(), entry_id, pairs_to_fields(pairs))
            for lane, entries in reply
            for entry_id, pairs in entries
        ]
