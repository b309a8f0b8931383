"""Size limits on library code, so that each function reads on one screen and each file holds
one idea: no Python function over 60 lines and no Python file over 600 in the package's
folders; no C++ function over 80 lines and no C++ file over 400 in the kernels' sources.
Fast: it reads the sources, imports nothing of the package."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("vlmserve", "kernels", "models", "ui")
CSRC = ROOT / "kernels" / "csrc"
MAX_PY_FUNCTION, MAX_PY_FILE = 60, 600
MAX_CPP_FUNCTION, MAX_CPP_FILE = 80, 400


def python_files() -> list[Path]:
    return sorted(path for folder in LIBRARY for path in (ROOT / folder).rglob("*.py"))


def cpp_files() -> list[Path]:
    return sorted(path for path in CSRC.iterdir() if path.suffix in (".cpp", ".h"))


def line_count(path: Path) -> int:
    return len(path.read_text().splitlines())


def python_functions(source: str) -> list[tuple[str, int, int]]:
    """(name, first line, length) of every function and method, def line through body's end."""
    return [(node.name, node.lineno, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


# a comment, a string or character literal (raw strings too), or a preprocessor line with its continuations
_CPP_NOISE = re.compile(r'//[^\n]*|/\*.*?\*/|R"([^(\s]*)\(.*?\)\1"|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\''
                        r'|^[ \t]*#(?:\\\n|[^\n])*', re.S | re.M)


def blank_cpp_noise(source: str) -> str:
    """The source with comments, literals and preprocessor lines blanked, newlines kept: braces
    in them do not count, and the line numbers stay."""
    return _CPP_NOISE.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), source)


# what a function's header ends with after its parameters: qualifiers, a trailing return type
_FUNCTION_TAIL = re.compile(r"\)\s*(?:(?:const|noexcept|override|final|mutable|&&?)\s*|->[^;{}]*)*$")
# a namespace's, class's or `extern "C"`'s body (its string blanked): its functions are looked at
_SCOPE = re.compile(r"(?:^|[\s)])(?:namespace(?:\s+[\w:]+)?|extern|(?:struct|class|union)\b[^()]*)$")
# a constructor's member initializers, after its parameters
_INIT_LIST = re.compile(r"\)\s*(?:noexcept\s*)?:(?!:).*$", re.S)
_TEMPLATE_PREFIX = re.compile(r"^\s*template\s*<[^{};]*?>\s*(?=[A-Za-z_])", re.S)


def cpp_functions(source: str) -> list[tuple[str, int, int]]:
    """(name, first line, length) of every function defined at namespace, file or class scope:
    from the line of its signature (after any `template <...>` line) to its closing brace."""
    text = blank_cpp_noise(source)
    functions = []
    header_start = 0  # where the text since the last statement or brace at this level starts
    i = 0
    while i < len(text):
        if text[i] in ";}":
            header_start = i + 1
        elif text[i] == "{":
            header = text[header_start:i].strip()
            if _SCOPE.search(header):
                header_start = i + 1
            else:  # a body, or an initializer (of a variable, or of a member in a constructor's list)
                end = _matching_brace(text, i)
                signature = _INIT_LIST.sub(")", header)
                if _FUNCTION_TAIL.search(signature) and (signature == header or header[-1] in ")}"):
                    template = _TEMPLATE_PREFIX.match(header)
                    start = i - len(text[header_start:i].lstrip()) + (len(template.group()) if template else 0)
                    first, last = text.count("\n", 0, start) + 1, text.count("\n", 0, end) + 1
                    functions.append((_function_name(signature), first, last - first + 1))
                    header_start = end + 1
                i = end
        i += 1
    return functions


def _function_name(header: str) -> str:
    """The name before the parameter list (the header's last parenthesised group)."""
    close = header.rindex(")")
    depth = 0
    for i in range(close, -1, -1):
        depth += {")": 1, "(": -1}.get(header[i], 0)
        if depth == 0:
            name = re.search(r"(operator\s*\S+?|[~\w:]+)\s*$", header[:i])
            return name.group(1) if name else header[:40]
    return header[:40]


def _matching_brace(text: str, start: int) -> int:
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return i
    raise AssertionError(f"unbalanced braces from offset {start}")


def test_the_cpp_scanner_finds_functions_and_ignores_braces_in_comments_and_strings():
    source = '''#include <x.h>
#define BRACE {
MACRO(x)
namespace a {
struct S {
  S() : x{1} {}
  int f() const { return 1; }
  int x;
};
template <int N>
inline void g(int x) {
  const char* s = "}{";  // don't }
  /* { */ auto h = [&](int y) { return y; };
  char c = '{';
}
int table[] = {1, 2};
enum class E : int { kA, kB };
}  // namespace a
extern "C" {
void h(void) {
}
}
'''
    assert cpp_functions(source) == [("S", 6, 1), ("f", 7, 1), ("g", 11, 5), ("h", 20, 2)]
    assert cpp_functions("struct T {\n  T(int a) : a_(a), b_{a} {\n  }\n  int a_, b_;\n};\n") == [("T", 2, 2)]


def test_no_python_function_over_60_lines():
    long = {str(p.relative_to(ROOT)): found for p in python_files()
            if (found := [f for f in python_functions(p.read_text()) if f[2] > MAX_PY_FUNCTION])}
    assert not long, f"functions over {MAX_PY_FUNCTION} lines (name, first line, length): {long}"


def test_no_python_file_over_600_lines():
    long = {str(p.relative_to(ROOT)): line_count(p) for p in python_files() if line_count(p) > MAX_PY_FILE}
    assert not long, f"files over {MAX_PY_FILE} lines: {long}"


def test_no_cpp_function_over_80_lines():
    long = {p.name: found for p in cpp_files()
            if (found := [f for f in cpp_functions(p.read_text()) if f[2] > MAX_CPP_FUNCTION])}
    assert not long, f"functions over {MAX_CPP_FUNCTION} lines (name, first line, length): {long}"


def test_no_cpp_file_over_400_lines():
    long = {p.name: line_count(p) for p in cpp_files() if line_count(p) > MAX_CPP_FILE}
    assert not long, f"files over {MAX_CPP_FILE} lines: {long}"


def test_the_environment_is_read_in_one_module_and_every_variable_is_documented():
    """vlmserve/envs.py is the one module of the library that touches os.environ or getenv
    (read when used, never at import); every variable it reads is in docs/environment.md."""
    readers = []
    for path in python_files():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            touches = (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv")
                       and isinstance(node.value, ast.Name) and node.value.id == "os")
            if touches and path != ROOT / "vlmserve" / "envs.py":
                readers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not readers, f"environment read outside vlmserve/envs.py: {readers}"
    import vlmserve.envs as envs

    documented = (ROOT / "docs" / "environment.md").read_text()
    assert [name for name in envs.VARIABLES if f"`{name}`" not in documented] == []
