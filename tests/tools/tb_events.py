"""Prints every scalar of the TensorBoard event files in DIR as "tag step value", one per line, read
back with tensorboardX's protobuf classes from the TFRecord framing (length, CRC, event, CRC).
A test's reader: tools/plot.py --tensorboard writes the files, this checks what they hold."""
import glob
import os
import struct
import sys

from tensorboardX.proto import event_pb2


def records(path):
    with open(path, "rb") as f:
        while True:
            head = f.read(12)
            if not head:
                return
            if len(head) < 12:
                raise SystemExit(f"{path}: truncated record header")
            (n,) = struct.unpack("<Q", head[:8])
            data = f.read(n)
            if len(data) < n or len(f.read(4)) < 4:
                raise SystemExit(f"{path}: truncated record")
            yield data


def main():
    files = sorted(glob.glob(os.path.join(sys.argv[1], "events.out.tfevents.*")))
    if not files:
        raise SystemExit(f"{sys.argv[1]}: no events.out.tfevents.* file")
    for path in files:
        for data in records(path):
            ev = event_pb2.Event()
            ev.ParseFromString(data)
            for v in ev.summary.value:
                if v.HasField("simple_value"):
                    print(v.tag, ev.step, repr(v.simple_value))


if __name__ == "__main__":
    main()
