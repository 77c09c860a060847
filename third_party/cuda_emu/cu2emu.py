#!/usr/bin/env python3
"""Rewrite a .cu file so that g++ can compile it against cuda_emu.h.

Usage: cu2emu.py in.cu out.cc

- Launches `K<<<cfg>>>(args)` become `::emu::kernel(K, "K").cfg(cfg)(args)`.
- `__shared__ T name[N];` (or a scalar) inside a function becomes a
  thread_local static (one block runs on an OS thread at a time) followed, on
  the same line, by `::emu::shared_init(&name, sizeof(name));`, which poisons
  it once per block.
- `extern __shared__ T name[];` becomes a pointer to the block's dynamic
  shared memory.
Line numbers are kept (a #line directive names the .cu), so compiler errors
and the emulator's file:line messages point into the .cu. Anything it cannot
parse (file-scope or multi-name __shared__, a __shared__ in a macro, a
kernel expression before <<<) fails the build with the offset's line.
"""
import re
import sys

IDENT = r'[A-Za-z_]\w*'
# A type: identifiers, ::, template arguments, pointers, cv; no parentheses.
TYPE = r'[A-Za-z_][\w:<>,\s*&]*?'
ALIGN = r'(?:(?:alignas|__align__)\s*\(\s*\w+\s*\)\s*)?'


def mask(src):
    """src with comments and string/char literals blanked (same length and
    newlines), so that the searches below only see code."""
    out, i, n = list(src), 0, len(src)

    def blank(a, b):
        for k in range(a, b):
            if out[k] != '\n':
                out[k] = ' '

    while i < n:
        c = src[i]
        if src.startswith('//', i):
            j = src.find('\n', i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
        elif src.startswith('/*', i):
            j = src.find('*/', i + 2)
            j = n if j < 0 else j + 2
            blank(i, j)
            i = j
        elif c == 'R' and src.startswith('R"', i) and not (i and (src[i - 1].isalnum() or src[i - 1] == '_')):
            d = src[i + 2:src.index('(', i)]
            j = src.index(')' + d + '"', i) + len(d) + 2
            blank(i, j)
            i = j
        elif c == '"' or (c == "'" and not (i and src[i - 1].isalnum())):  # not a digit separator
            j = i + 1
            while src[j] != c:
                j += 2 if src[j] == '\\' else 1
            blank(i + 1, j)
            i = j + 1
        else:
            i += 1
    return ''.join(out)


def line_of(src, off):
    return src.count('\n', 0, off) + 1


def fail(path, src, off, msg):
    sys.exit(f'{path}:{line_of(src, off)}: cu2emu: {msg}')


def scope_kinds(code):
    """For each '{' offset: 'file' if it opens a namespace or extern "C"
    block (so what it holds is at file scope), else 'code'."""
    kinds, start = {}, 0
    for m in re.finditer(r'[{};]', code):
        if m.group() == '{':
            head = code[start:m.start()]
            kinds[m.start()] = 'file' if re.search(r'(\bnamespace\b[\w\s:]*|\bextern\s*"\s*"\s*)$', head) else 'code'
        start = m.end()
    return kinds


def at_file_scope(code, kinds, off):
    stack = []
    for m in re.finditer(r'[{}]', code[:off]):
        if m.group() == '{':
            stack.append(kinds[m.start()])
        elif stack:
            stack.pop()
    return all(k == 'file' for k in stack)


def strip_template_args(typ):
    while True:
        t = re.sub(r'<[^<>]*>', '', typ)
        if t == typ:
            return t
        typ = t


def rewrite_shared(path, src, code):
    """Edits (offset, end, text) for every __shared__ declaration."""
    kinds, edits = scope_kinds(code), []
    for m in re.finditer(r'\b__shared__\b', code):
        line_start = code.rfind('\n', 0, m.start()) + 1
        if code[line_start:m.start()].lstrip().startswith('#'):
            fail(path, src, m.start(), '__shared__ inside a macro is not supported')
        if at_file_scope(code, kinds, m.start()):
            fail(path, src, m.start(), 'file-scope __shared__ is not supported: declare it inside the kernel')
        ext = re.search(r'\bextern\s+$', code[line_start:m.start()])
        begin = line_start + ext.start() if ext else m.start()
        end = code.find(';', m.end())
        decl = code[m.end():end]
        if ext:
            d = re.fullmatch(rf'\s*{ALIGN}({TYPE})\s*\b({IDENT})\s*\[\s*\]\s*', decl)
            if not d:
                fail(path, src, m.start(), f'cannot parse extern __shared__ declaration {decl.strip()!r}')
            typ, name = d.group(1).strip(), d.group(2)
            text = f'{typ}* const {name} = static_cast<{typ}*>(::emu::dynamic_shared());'
        else:
            d = re.fullmatch(rf'\s*{ALIGN}({TYPE})\s*\b({IDENT})\s*((?:\[[^\]\[;=]+\]\s*)*)', decl)
            if not d or ',' in strip_template_args(d.group(1)):
                fail(path, src, m.start(), f'cannot parse __shared__ declaration {decl.strip()!r} '
                     '(one name per declaration, no initializer)')
            name = d.group(2)
            text = f'static thread_local{decl}; ::emu::shared_init(&{name}, sizeof({name}));'
        edits.append((begin, end + 1, text))
    return edits


def rewrite_launches(path, src, code):
    edits = []
    for m in re.finditer(r'<<<', code):
        i = m.start()
        # Walk back over the kernel expression: name[::name][<template args>].
        j = i
        while code[j - 1].isspace():
            j -= 1
        if code[j - 1] == '>':
            depth = 0
            while True:
                j -= 1
                if code[j] == '>':
                    depth += 1
                elif code[j] == '<':
                    depth -= 1
                    if depth == 0:
                        break
        k = j
        while k > 0 and (code[k - 1].isalnum() or code[k - 1] in '_:'):
            k -= 1
        kernel = src[k:i].rstrip()
        if not re.fullmatch(r'[A-Za-z_:][\w:]*(<.*>)?', kernel, re.S):
            fail(path, src, i, f'cannot parse the kernel before <<<: {kernel!r}')
        end = code.index('>>>', i)
        name = re.sub(r'\s+', ' ', kernel)
        edits.append((k, end + 3, f'::emu::kernel({kernel}, "{name}").cfg({src[i + 3:end]})'))
    return edits


def main():
    path, out_path = sys.argv[1], sys.argv[2]
    src = open(path).read()
    code = mask(src)
    launches = rewrite_launches(path, src, code)
    shared = rewrite_shared(path, src, code)
    out, pos = [], 0
    for begin, end, text in sorted(launches + shared):
        if begin < pos:
            fail(path, src, begin, 'a <<< launch and a __shared__ declaration overlap')
        out.append(src[pos:begin])
        out.append(text + '\n' * (src[begin:end].count('\n') - text.count('\n')))
        pos = end
    out.append(src[pos:])
    open(out_path, 'w').write(f'#line 1 "{path}"\n' + ''.join(out))
    print(f'{path}: {len(launches)} launches, {len(shared)} __shared__ rewritten', file=sys.stderr)


if __name__ == '__main__':
    main()
