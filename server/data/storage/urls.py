"""Object URLs: which paths are objects, their parts, and their globs."""

from __future__ import annotations

import re

# The schemes a dataset's `paths` may use for objects, as obstore names them.
SCHEMES = ("gs", "s3", "az")
_URL = re.compile(r"^(gs|s3|az)://([^/]+)/?(.*)$")
_GLOB_CHARS = re.compile(r"[*?\[]")


def is_url(path: str) -> bool:
  """Whether `path` names objects (gs://, s3://, az://) rather than files."""
  return _URL.match(path) is not None


def split(url: str) -> tuple[str, str, str]:
  """(scheme, bucket, key) of an object URL; ValueError if it is not one."""
  m = _URL.match(url)
  if m is None or not m.group(2):
    raise ValueError(f"{url!r} is not a gs://, s3:// or az:// URL with a bucket")
  return m.group(1), m.group(2), m.group(3)


def join(scheme: str, bucket: str, key: str) -> str:
  return f"{scheme}://{bucket}/{key}"


def glob_prefix(key_pattern: str) -> str:
  """The literal folder a key pattern lists under: "a/b/x-*.ar" -> "a/b/"."""
  m = _GLOB_CHARS.search(key_pattern)
  literal = key_pattern if m is None else key_pattern[:m.start()]
  return literal[:literal.rfind("/") + 1]


def glob_regex(key_pattern: str) -> re.Pattern[str]:
  """A key pattern as a regex: `*` and `?` stay within one folder, `**`
  spans folders, `[...]` is a class (as glob.glob takes them)."""
  out, i = [], 0
  while i < len(key_pattern):
    c = key_pattern[i]
    if key_pattern.startswith("**", i):
      out.append(".*")
      i += 2
      if key_pattern.startswith("/", i):  # "a/**/b" matches "a/b" too
        out[-1] = "(?:.*/)?"
        i += 1
      continue
    if c == "*":
      out.append("[^/]*")
    elif c == "?":
      out.append("[^/]")
    elif c == "[":
      end = key_pattern.find("]", i + 2)
      if end < 0:
        out.append(re.escape(c))
      else:
        body = key_pattern[i + 1:end]
        out.append("[" + ("^" + re.escape(body[1:]) if body[:1] == "!" else re.escape(body)) + "]")
        i = end
    else:
      out.append(re.escape(c))
    i += 1
  return re.compile("".join(out) + r"\Z")
