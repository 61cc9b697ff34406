#!/usr/bin/env python3
"""An independent reader of TensorBoard event files, to check the ones `strata train` writes.

Debian 12 packages neither TensorBoard nor TensorFlow, so this script reads the files as their
formats are specified, with Debian's python3-crc32c for the checksums:
  - TFRecord: uint64 little-endian length, uint32 masked CRC-32C of those 8 bytes, the record,
    uint32 masked CRC-32C of the record (mask: rotate right 15, add 0xa282ead8); the file ends
    exactly after a record;
  - each record an Event protocol buffer: wall_time (1, double), step (2, int64), file_version
    (3, string), summary (5, Summary: repeated value (1, Value: tag (1, string),
    simple_value (2, float))) or session_log (6, SessionLog: status (1, enum)). Any other
    field, wire type or a truncated field is an error.
The first event of a file must be the file version "brain.Event:2" and no other event may be.
A session log with status START (1) at step S drops every scalar read before it at step S or
later, as TensorBoard does when a run restarts (SummaryWriter's purge_step).

usage: tfevents_reader.py DIR
Prints one JSON object: {"files": N, "scalars": {tag: [[step, value], ...]}} over every
events.out.tfevents.* file in DIR, in file name order. Exit status: 0, 1 with a message on
any violation, 77 without the crc32c module.
"""
import glob
import json
import os
import struct
import sys

try:
    import crc32c
except ImportError:  # the C++ test reports a skip, naming python3-crc32c
    sys.exit(77)


def masked(data):
    c = crc32c.crc32c(data)
    return ((((c >> 15) | (c << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


class Bad(Exception):
    pass


def varint(buf, pos):
    value, shift = 0, 0
    while True:
        if pos >= len(buf):
            raise Bad("varint runs past the end")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, pos
        if shift > 63:
            raise Bad("varint longer than 10 bytes")


def fields(buf):
    """(field number, wire type, value) of each field of a message."""
    pos = 0
    while pos < len(buf):
        key, pos = varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = varint(buf, pos)
        elif wire == 1:
            if pos + 8 > len(buf):
                raise Bad("64-bit field runs past the end")
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 2:
            n, pos = varint(buf, pos)
            if pos + n > len(buf):
                raise Bad("length-delimited field runs past the end")
            value, pos = buf[pos:pos + n], pos + n
        elif wire == 5:
            if pos + 4 > len(buf):
                raise Bad("32-bit field runs past the end")
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise Bad("wire type %d" % wire)
        yield number, wire, value


def read_value(buf):
    tag, simple = None, None
    for number, wire, value in fields(buf):
        if number == 1 and wire == 2:
            tag = value.decode("utf-8")
        elif number == 2 and wire == 5:
            simple = struct.unpack("<f", value)[0]
        else:
            raise Bad("Summary.Value field %d (wire %d)" % (number, wire))
    if tag is None or simple is None:
        raise Bad("a Summary.Value without a tag or a simple_value")
    return tag, simple


def read_event(buf):
    event = {"values": []}
    for number, wire, value in fields(buf):
        if number == 1 and wire == 1:
            event["wall_time"] = struct.unpack("<d", value)[0]
        elif number == 2 and wire == 0:
            event["step"] = value - (1 << 64) if value >= 1 << 63 else value
        elif number == 3 and wire == 2:
            event["file_version"] = value.decode("utf-8")
        elif number == 6 and wire == 2:
            for n, w, v in fields(value):
                if n != 1 or w != 0:
                    raise Bad("SessionLog field %d (wire %d)" % (n, w))
                event["session_status"] = v
        elif number == 5 and wire == 2:
            for n, w, v in fields(value):
                if n != 1 or w != 2:
                    raise Bad("Summary field %d (wire %d)" % (n, w))
                event["values"].append(read_value(v))
        else:
            raise Bad("Event field %d (wire %d)" % (number, wire))
    if "wall_time" not in event:
        raise Bad("an Event without wall_time")
    return event


def read_file(path, scalars):
    data = open(path, "rb").read()
    pos, index = 0, 0
    while pos < len(data):
        if pos + 12 > len(data):
            raise Bad("%s: a record header cut short at byte %d" % (path, pos))
        header = data[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack("<I", data[pos + 8:pos + 12])
        if header_crc != masked(header):
            raise Bad("%s: record %d: the length's CRC is wrong" % (path, index))
        body = data[pos + 12:pos + 12 + length]
        if len(body) != length or pos + 16 + length > len(data):
            raise Bad("%s: record %d cut short" % (path, index))
        (body_crc,) = struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])
        if body_crc != masked(body):
            raise Bad("%s: record %d: the data's CRC is wrong" % (path, index))
        event = read_event(body)
        if index == 0:
            if event.get("file_version") != "brain.Event:2" or event["values"]:
                raise Bad("%s: the first event is not the file version" % path)
        elif "file_version" in event:
            raise Bad("%s: record %d repeats the file version" % (path, index))
        if event.get("session_status") == 1:
            start = event.get("step", 0)
            for tag in scalars:
                scalars[tag] = [p for p in scalars[tag] if p[0] < start]
        for tag, value in event["values"]:
            scalars.setdefault(tag, []).append([event.get("step", 0), value])
        pos += 16 + length
        index += 1
    if index == 0:
        raise Bad("%s: no records" % path)


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    paths = sorted(glob.glob(os.path.join(sys.argv[1], "events.out.tfevents.*")))
    if not paths:
        print("no events.out.tfevents.* in %s" % sys.argv[1], file=sys.stderr)
        return 1
    scalars = {}
    try:
        for p in paths:
            read_file(p, scalars)
    except Bad as e:
        print(e, file=sys.stderr)
        return 1
    print(json.dumps({"files": len(paths), "scalars": scalars}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
