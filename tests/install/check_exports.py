#!/usr/bin/python3
"""libgradlink.so exports the public API, all of it and nothing else.

    check_exports.py LIBRARY INCLUDE_DIR

Reads the declarations of INCLUDE_DIR/gradlink/*.h (namespace gradlink: classes, member
functions, free functions) and the library's exported dynamic symbols (`nm -D --defined-only`,
demangled with `c++filt`), and fails (exit 1, listing them) on

- an exported symbol that is not a name those headers declare: a function or member function of
  namespace gradlink, or the vtable / typeinfo of a class declared there (their
  unavoidable companions);
- a function those headers declare without defining it inline (so the library must define it)
  that the library does not export (a class left out of libgradlink, or a missing
  GRADLINK_EXPORT).

Prints the number of exported symbols. Needs binutils (nm, c++filt).
"""

import os
import re
import subprocess
import sys

# Prefixes of the data symbols a class with virtual functions brings.
CLASS_DATA = ("vtable for ", "typeinfo for ", "typeinfo name for ")


def strip_comments(text):
    text = re.sub(r"\\\n", " ", text)  # a macro's continuation lines
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    text = re.sub(r'"(\\.|[^"\\])*"', '""', text)
    return re.sub(r"^\s*#[^\n]*", " ", text, flags=re.M)


TOKEN = re.compile(r"::|operator\s*(?:==|!=|<=>|\(\)|\[\]|[-+*/<>=!]+)|[A-Za-z_~][A-Za-z_0-9]*|\S")
NAME = re.compile(r"^(~?[A-Za-z_]\w*|operator.*)$")
# (Keywords and types before a "(" that declare no function: `std::function<void(int)>`.)
NOT_FUNCTIONS = {"if", "while", "for", "switch", "return", "sizeof", "decltype", "alignas",
                 "noexcept", "static_assert", "__attribute__", "GRADLINK_EXPORT", "void", "bool",
                 "int"}


def declarations(text):
    """(classes, functions) of one header: the qualified names of its classes, and
    (qualified name, needs no definition in the library) for each function declared in a
    namespace or class scope (inline, = 0, = default and = delete need none)."""
    toks = TOKEN.findall(strip_comments(text))
    classes, functions = set(), []
    stack = []       # open scopes: (kind, name), kind "namespace", "class" or "block"
    pending = None   # what the next "{" opens: ("namespace" | "class", name)
    current = None   # [name, index of its "("] of the function being declared
    paren = 0
    i = 0

    def scope():
        return [n for k, n in stack if k in ("namespace", "class") and n]

    def in_decl_scope():
        return all(k in ("namespace", "class") for k, _ in stack)

    while i < len(toks):
        t = toks[i]
        if t == "template" and i + 1 < len(toks) and toks[i + 1] == "<":
            depth, i = 1, i + 2
            while i < len(toks) and depth:
                depth += {"<": 1, ">": -1}.get(toks[i], 0)
                i += 1
            continue
        if t == "(":
            if (paren == 0 and current is None and in_decl_scope() and i > 0 and
                    NAME.match(toks[i - 1]) and toks[i - 1] not in NOT_FUNCTIONS):
                current = ["::".join(scope() + [toks[i - 1]]), i]
            paren += 1
        elif t == ")":
            paren -= 1
        elif paren:
            pass
        elif t == "namespace" and current is None:
            pending = ("namespace", toks[i + 1] if toks[i + 1] != "{" else "")
        elif t in ("class", "struct") and current is None and not (i and toks[i - 1] == "enum"):
            # Its name: the last identifier before "{", ":" or ";".
            j, name = i + 1, None
            while j < len(toks) and toks[j] not in ("{", ":", ";"):
                if re.match(r"^[A-Za-z_]\w*$", toks[j]) and toks[j] not in (
                        "GRADLINK_EXPORT", "nodiscard", "final"):
                    name = toks[j]
                j += 1
            if j < len(toks) and toks[j] in ("{", ":") and name:
                pending = ("class", name)
                classes.add("::".join(scope() + [name]))
        elif t == "{":
            stack.append(pending if pending else ("block", ""))
            pending = None
            if current is not None:  # a body: defined inline
                functions.append((current[0], True))
                current = None
        elif t == "}":
            stack.pop()
        elif t == ";":
            pending = None
            if current is not None:
                tail = toks[current[1]:i]
                functions.append((current[0], "=" in tail and tail[-1] in ("0", "default",
                                                                           "delete")))
                current = None
        i += 1
    return classes, functions


def exported(library):
    nm = subprocess.run(["nm", "-D", "--defined-only", library], check=True,
                        capture_output=True, text=True).stdout
    mangled = [line.split()[-1] for line in nm.splitlines() if line.strip()]
    demangled = subprocess.run(["c++filt"], input="\n".join(mangled), check=True,
                               capture_output=True, text=True).stdout.splitlines()
    return list(zip(mangled, demangled))


def qualified_name(demangled):
    """"gradlink::Worker::Connect(gradlink::WorkerOptions const&)" -> "gradlink::Worker::Connect"
    (None for a symbol that is not a function)."""
    s = demangled.replace("[abi:cxx11]", "")
    depth = 0
    for k, c in enumerate(s):
        if c == "<":
            depth += 1
        elif c == ">":
            depth -= 1
        elif c == "(" and depth == 0 and not s[:k].endswith("operator"):
            return s[:k]
    return None


def main():
    library, include_dir = sys.argv[1], sys.argv[2]
    headers = sorted(os.path.join(include_dir, "gradlink", f)
                     for f in os.listdir(os.path.join(include_dir, "gradlink"))
                     if f.endswith(".h"))
    classes, functions = set(), []
    for h in headers:
        c, f = declarations(open(h).read())
        classes |= c
        functions += f
    declared = {name for name, _ in functions}
    needed = {name for name, no_definition in functions if not no_definition}

    symbols = exported(library)
    unexpected, found = [], set()
    for mangled, name in symbols:
        data = next((p for p in CLASS_DATA if name.startswith(p)), None)
        if data:
            if name[len(data):] in classes:
                continue
        else:
            q = qualified_name(name)
            if q in declared:
                found.add(q)
                continue
        unexpected.append("%s   (%s)" % (name, mangled))
    missing = sorted(needed - found)

    print("%s: %d exported symbols; %d classes and %d functions declared in %s "
          "(%d to be defined by the library)" % (library, len(symbols), len(classes),
                                                 len(declared), include_dir, len(needed)))
    if unexpected:
        print("\nExported, but not declared in include/gradlink/ (%d):" % len(unexpected))
        for u in sorted(unexpected):
            print("  " + u)
    if missing:
        print("\nDeclared in include/gradlink/, not exported by the library (%d):" % len(missing))
        for m in missing:
            print("  " + m)
    if unexpected or missing:
        return 1
    print("OK: the library exports exactly the public API")
    return 0


if __name__ == "__main__":
    sys.exit(main())
