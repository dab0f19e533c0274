#!/usr/bin/env python3
"""The largest classes of the daemon: method declarations and lock requirements per class.

Reads clang's AST of every non-test translation unit under daemon/ (the compile commands of a
build directory configured with -DCMAKE_EXPORT_COMPILE_COMMANDS=ON) and, for each class or
struct of the project defined in a header or source under daemon/, counts
  - the methods it declares (constructors, destructor, deleted and static ones included;
    nothing the compiler declares implicitly), and
  - its methods that require a lock (ABSL_EXCLUSIVE_LOCKS_REQUIRED / ABSL_SHARED_LOCKS_REQUIRED),
    by the lock named.
The code-health rule it serves: no class above about 40 methods or 15 methods requiring one
mutex.

Usage: scripts/class_sizes.py BUILD_DIR [--top N] [--max-methods M --max-requires R]
With the limits, exits 1 when a class exceeds one (and names it).
"""
import argparse
import collections
import json
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHOD_KINDS = ('CXXMethodDecl', 'CXXConstructorDecl', 'CXXDestructorDecl',
                'CXXConversionDecl')
RECORD = re.compile(r"CXXRecordDecl 0x[0-9a-f]+ (?:prev 0x[0-9a-f]+ )?<[^>]*>.* "
                    r"(class|struct) (\w+) definition")
KIND = re.compile(r"[A-Za-z]")
FILE_LOC = re.compile(r"[<, ](/[^:<>, ]+):\d+:\d+")
REQUIRES_MEMBER = re.compile(r"MemberExpr .* (->|\.)(\w+) ")


def clang_command(entry):
  args = shlex.split(entry['command'])
  out, skip = ['clang++'], False
  for a in args[1:]:
    if skip:
      skip = False
      continue
    if a == '-o':
      skip = True
      continue
    if a == '-c' or a.startswith('-fprofile') or a == entry['file']:
      continue
    out.append(a)
  return out + ['-fsyntax-only', '-Wno-everything', '-Xclang', '-ast-dump', '-Xclang',
                '-ast-dump-filter', '-Xclang', 'refit::', entry['file']]


def classes_of(entry):
  """{name: (file, methods, {lock: count})} for the records of daemon/ one TU defines."""
  dump = subprocess.run(clang_command(entry), cwd=entry['directory'], capture_output=True,
                        text=True).stdout
  lines = dump.splitlines()
  indents = [KIND.search(l).start() if KIND.search(l) else 0 for l in lines]
  # The dump names a file only where it changes from the node before: track it.
  files, current = [], ''
  for line in lines:
    loc = FILE_LOC.search(line)
    files.append(loc.group(1) if loc and RECORD.search(line) else current)
    if loc:
      current = loc.group(1)
  found = {}
  for i, line in enumerate(lines):
    m = RECORD.search(line)
    if not m or indents[i] != line.index('CXXRecordDecl'):
      continue
    path = files[i]
    path = os.path.relpath(path, ROOT) if path.startswith(ROOT) else path
    if not path.startswith('daemon/'):
      continue
    methods, locks, kind = 0, collections.Counter(), None
    for j in range(i + 1, len(lines)):
      if indents[j] <= indents[i]:
        break
      if indents[j] == indents[i] + 2:
        kind = lines[j][indents[j]:].split(' ')[0]
        if kind in METHOD_KINDS and ' implicit ' not in lines[j]:
          methods += 1
      elif kind in METHOD_KINDS and 'RequiresCapabilityAttr' in lines[j]:
        # The lock is the attribute's argument, on the next line(s).
        k = j + 1
        while k < len(lines) and 'MemberExpr' not in lines[k] and 'DeclRefExpr' not in lines[k]:
          k += 1
        lock = REQUIRES_MEMBER.search(lines[k]) if k < len(lines) else None
        locks[lock.group(2) if lock else '?'] += 1
    if methods:
      found[m.group(2)] = (path, methods, dict(locks))
  return found


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('build_dir')
  ap.add_argument('--top', type=int, default=12)
  ap.add_argument('--max-methods', type=int)
  ap.add_argument('--max-requires', type=int)
  ap.add_argument('--jobs', type=int, default=os.cpu_count() or 2)
  a = ap.parse_args()
  entries = [e for e in json.load(open(os.path.join(a.build_dir, 'compile_commands.json')))
             if os.path.relpath(e['file'], ROOT).startswith('daemon/')
             and not re.search(r'(_test|_fuzzer|_testing|_main)\.cc$', e['file'])]
  seen = {}
  with ThreadPoolExecutor(a.jobs) as pool:
    for found in pool.map(classes_of, entries):
      for name, info in found.items():
        if not info[0].startswith('daemon/'):
          continue
        if name not in seen or info[1] > seen[name][1]:
          seen[name] = info
  rows = sorted(seen.items(), key=lambda kv: (-kv[1][1], kv[0]))
  print(f"{'class':32} {'methods':>7}  requires (by lock)  file")
  for name, (path, methods, locks) in rows[:a.top]:
    req = ', '.join(f'{n} {l}' for l, n in sorted(locks.items(), key=lambda kv: -kv[1])) or '-'
    print(f'{name:32} {methods:7}  {req:18}  {path}')
  bad = [name for name, (_, methods, locks) in rows
         if (a.max_methods is not None and methods > a.max_methods)
         or (a.max_requires is not None and any(n > a.max_requires for n in locks.values()))]
  if bad:
    print('over the limits: ' + ', '.join(bad))
    return 1
  return 0


if __name__ == '__main__':
  sys.exit(main())
