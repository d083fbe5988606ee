//! A Go `text/template` engine over `serde_json::Value` data, so that Weir renders Istio's
//! Envoy bootstrap template exactly as pilot-agent does.
//!
//! [`Template::parse`] turns the text into a tree: text, `{{pipeline}}` actions, comments, trim
//! markers, `if`/`else if`/`else`, `with`/`else with`, `range`/`else`, `break`/`continue`,
//! variables (`$x :=`, `$x =`, `$i, $v :=` in range), pipelines with `|`, parenthesised
//! pipelines and literals. [`Template::render`] walks the tree over JSON data. [`Functions`]
//! holds what templates may call: Go's builtins plus the embedder's (see
//! [`Functions::with_istio`] for Istio's `toJson`/`toJSON`).
//!
//! Data behaves as the same values inside Go's `map[string]interface{}`: objects are maps
//! (iterated, printed and marshalled in sorted key order), integers written without `.`/`e` are
//! Go `int`s and other numbers `float64`s, a missing key is Go's "no value" (printed `<no value>`,
//! false), null is a nil `interface{}`. As in Go, a pipeline's result that is a nil interface
//! becomes "no value", so `{{.k}}` prints `<no value>` for a null `k` too, while a null inside an
//! array or passed to `print`/`printf` prints `<nil>`.
//!
//! Differences from Go, all outside what Istio's bootstrap template uses:
//! - `define`, `template` and `block` are rejected at parse time; `call` and `slice` don't exist.
//! - `printf` knows flags `-+# 0`, width, precision and verbs `v s d t q x X o b c e E f F g G`;
//!   not `*`, `[n]` or `%#v`'s Go syntax.
//! - `js` and `%q` judge printability with Rust's Unicode data plus a list of format and
//!   private-use ranges: unassigned code points stay as they are, where Go escapes them.
//! - A JSON object can't say it was a Go struct: `toJson` writes sorted keys where Go writes struct
//!   fields in declaration order (Istio's `histogram_buckets`: same JSON, other key order).
//! - Errors carry a 1-based line and column (Go: line only when parsing, a byte offset when
//!   executing) and no `at <node>` part; messages name JSON's Go types (`string`,
//!   `[]interface {}`) where Go may say `interface {}`. Some errors come at parse time where Go
//!   finds them executing: assigning an undeclared variable, a variable used in its own
//!   declaration, integer literals beyond int64. Complex and hex-float literals are rejected,
//!   and nesting is limited to 100 levels.

mod format;

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use serde_json::Value;

use self::format::go_type;
pub use self::format::to_json;

// ---------------------------------------------------------------------------------------------
// Errors

/// Whether an error was found while parsing or while rendering.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Parse,
    Exec,
}

/// How many arguments a function takes, counting a value piped into it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arity {
    Exactly(usize),
    AtLeast(usize),
}

impl Arity {
    fn accepts(self, n: usize) -> bool {
        match self {
            Arity::Exactly(k) => n == k,
            Arity::AtLeast(k) => n >= k,
        }
    }
}

impl fmt::Display for Arity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Arity::Exactly(k) => write!(f, "{k}"),
            Arity::AtLeast(k) => write!(f, "at least {k}"),
        }
    }
}

/// What went wrong, worded as Go words it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ErrorKind {
    #[error("unclosed action")]
    UnclosedAction,
    #[error("unclosed comment")]
    UnclosedComment,
    #[error("unexpected EOF: {{{{{0}}}}} has no matching {{{{end}}}}")]
    Unclosed(&'static str),
    #[error("unexpected {0}")]
    Unexpected(String),
    #[error("function {0:?} not defined")]
    UnknownFunction(String),
    #[error("undefined variable {0:?}")]
    UndefinedVariable(String),
    #[error("{{{{{0}}}}} is not supported")]
    Unsupported(String),
    #[error("{0}")]
    Syntax(String),
    #[error("wrong number of args for {func}: want {want} got {got}")]
    ArgCount { func: String, want: Arity, got: usize },
    #[error("error calling index: index out of range: {0}")]
    IndexOutOfRange(i128),
    #[error("error calling {func}: {message}")]
    Call { func: String, message: String },
    #[error("{0}")]
    Type(String),
}

/// A parse or render failure: the template, where in it, and what.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("template: {name}:{line}:{col}: {}{kind}", exec_prefix(.phase, .name))]
pub struct TemplateError {
    pub name: String,
    pub line: usize,
    pub col: usize,
    pub phase: Phase,
    pub kind: ErrorKind,
}

fn exec_prefix(phase: &Phase, name: &str) -> String {
    match phase {
        Phase::Parse => String::new(),
        Phase::Exec => format!("executing {name:?}: "),
    }
}

/// An error at a byte offset of the source, before it is given a line and column.
#[derive(Debug)]
struct Fail(ErrorKind, usize);

impl TemplateError {
    fn new(name: &str, src: &str, Fail(kind, pos): Fail, phase: Phase) -> Self {
        let before = src.get(..pos).unwrap_or(src);
        let line = before.matches('\n').count() + 1;
        let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        TemplateError { name: name.to_owned(), line, col, phase, kind }
    }
}

fn syntax(message: impl Into<String>) -> ErrorKind {
    ErrorKind::Syntax(message.into())
}

fn call_err(func: &str, message: impl Into<String>) -> ErrorKind {
    ErrorKind::Call { func: func.to_owned(), message: message.into() }
}

// ---------------------------------------------------------------------------------------------
// Functions

/// A function registered by the embedder: arguments in order (a piped value last), Go's
/// "no value" passed as `Null`. An `Err` stops rendering with "error calling NAME: ...".
type CustomFn = Arc<dyn Fn(&[Value]) -> Result<Value, String> + Send + Sync>;

#[derive(Clone)]
enum Func {
    Builtin(Builtin),
    Custom(Arity, CustomFn),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Builtin {
    And,
    Or,
    Not,
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    Len,
    Index,
    Print,
    Println,
    Printf,
    Js,
    Html,
    Urlquery,
}

impl Builtin {
    const ALL: [(&'static str, Builtin); 17] = [
        ("and", Builtin::And),
        ("or", Builtin::Or),
        ("not", Builtin::Not),
        ("eq", Builtin::Eq),
        ("ne", Builtin::Ne),
        ("lt", Builtin::Lt),
        ("le", Builtin::Le),
        ("gt", Builtin::Gt),
        ("ge", Builtin::Ge),
        ("len", Builtin::Len),
        ("index", Builtin::Index),
        ("print", Builtin::Print),
        ("println", Builtin::Println),
        ("printf", Builtin::Printf),
        ("js", Builtin::Js),
        ("html", Builtin::Html),
        ("urlquery", Builtin::Urlquery),
    ];

    fn arity(self) -> Arity {
        use Builtin::*;
        match self {
            Not | Len => Arity::Exactly(1),
            Ne | Lt | Le | Gt | Ge => Arity::Exactly(2),
            And | Or | Eq | Index | Printf => Arity::AtLeast(1),
            Print | Println | Js | Html | Urlquery => Arity::AtLeast(0),
        }
    }
}

/// The functions templates may call, by name; checked at parse time as Go does.
#[derive(Clone)]
pub struct Functions {
    map: HashMap<String, Func>,
}

impl Default for Functions {
    /// Go's builtins: `and or not eq ne lt le gt ge len index print println printf js html urlquery`.
    fn default() -> Self {
        let map = Builtin::ALL.iter().map(|&(name, b)| (name.to_owned(), Func::Builtin(b))).collect();
        Functions { map }
    }
}

impl fmt::Debug for Functions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut names: Vec<_> = self.map.keys().collect();
        names.sort();
        f.debug_set().entries(names).finish()
    }
}

impl Functions {
    /// Go's builtins only.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `name`, replacing a builtin or earlier function of that name.
    pub fn register(
        &mut self,
        name: impl Into<String>,
        arity: Arity,
        f: impl Fn(&[Value]) -> Result<Value, String> + Send + Sync + 'static,
    ) -> &mut Self {
        self.map.insert(name.into(), Func::Custom(arity, Arc::new(f)));
        self
    }

    /// Adds what pilot-agent gives its bootstrap template: sprig's `toJson` (`json.Marshal`,
    /// `null` for nil) and Istio's `toJSON` (the same but `{}` for nil).
    pub fn with_istio(mut self) -> Self {
        self.register("toJson", Arity::Exactly(1), |args| {
            Ok(Value::String(args.first().map_or_else(|| "null".into(), to_json)))
        });
        self.register("toJSON", Arity::Exactly(1), |args| {
            Ok(Value::String(match args.first() {
                None | Some(Value::Null) => "{}".into(),
                Some(v) => to_json(v),
            }))
        });
        self
    }

    pub fn contains(&self, name: &str) -> bool {
        self.map.contains_key(name)
    }
}

// ---------------------------------------------------------------------------------------------
// Lexer: source text to tokens, with trim markers applied to the text around actions.

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Text(String),
    Open,
    Close,
    Field(String),
    Dot,
    Var(String),
    Ident(String),
    Lit(Value),
    Nil,
    LParen,
    RParen,
    Pipe,
    Declare,
    Assign,
    Comma,
    Eof,
    /// A lexing failure, reported when the parser reaches it (as Go's lazy lexer does).
    Error(ErrorKind),
}

#[derive(Debug, Clone)]
struct Token {
    tok: Tok,
    pos: usize,
    /// White space comes before it inside the action: separates operands.
    spaced: bool,
}

static EOF: Token = Token { tok: Tok::Eof, pos: 0, spaced: false };

fn is_space(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\r' | '\n')
}

fn is_alnum(c: char) -> bool {
    c == '_' || c.is_alphanumeric()
}

/// A closing delimiter at the start of `s`: its length and whether it trims (` -}}`).
fn close_delim(s: &str) -> Option<(usize, bool)> {
    let b = s.as_bytes();
    if b.len() >= 4 && is_space(char::from(b[0])) && &b[1..4] == b"-}}" {
        Some((4, true))
    } else if b.starts_with(b"}}") {
        Some((2, false))
    } else {
        None
    }
}

fn lex(src: &str) -> Vec<Token> {
    let mut toks = Vec::new();
    let end = match lex_into(src, &mut toks) {
        Ok(()) => Token { tok: Tok::Eof, pos: src.len(), spaced: false },
        Err(Fail(kind, pos)) => Token { tok: Tok::Error(kind), pos, spaced: false },
    };
    toks.push(end);
    toks
}

fn lex_into(src: &str, toks: &mut Vec<Token>) -> Result<(), Fail> {
    let mut pos = 0;
    let mut trim_start = false;
    loop {
        let rest = src.get(pos..).unwrap_or("");
        let open = rest.find("{{");
        let after = rest.get(open.map_or(rest.len(), |i| i + 2)..).unwrap_or("");
        let trim_end = open.is_some() && after.starts_with('-') && after[1..].starts_with(is_space);
        let mut text = &rest[..open.unwrap_or(rest.len())];
        if trim_start {
            text = text.trim_start_matches(is_space);
        }
        if trim_end {
            text = text.trim_end_matches(is_space);
        }
        if !text.is_empty() {
            toks.push(Token { tok: Tok::Text(text.to_owned()), pos, spaced: false });
        }
        let Some(open) = open else { return Ok(()) };
        let open = pos + open;
        pos = open + if trim_end { 4 } else { 2 };
        let (len, trim) = if src[pos..].starts_with("/*") {
            lex_comment(&src[pos..]).map_err(|kind| Fail(kind, open))?
        } else {
            toks.push(Token { tok: Tok::Open, pos: open, spaced: false });
            lex_action(src, open, pos, toks)?
        };
        pos += len;
        trim_start = trim;
    }
}

/// A comment `/* ... */` and its closing delimiter: bytes taken and whether it trims.
fn lex_comment(s: &str) -> Result<(usize, bool), ErrorKind> {
    let end = s.find("*/").ok_or(ErrorKind::UnclosedComment)? + 2;
    let (len, trim) =
        close_delim(&s[end..]).ok_or_else(|| syntax("comment ends before closing delimiter"))?;
    Ok((end + len, trim))
}

/// The tokens of an action starting at `start` (just after the `{{` opened at `open`), through
/// its `}}`: bytes taken and whether it trims.
fn lex_action(src: &str, open: usize, start: usize, toks: &mut Vec<Token>) -> Result<(usize, bool), Fail> {
    let mut pos = start;
    let mut spaced = false;
    loop {
        let rest = &src[pos..];
        if let Some((len, trim)) = close_delim(rest) {
            toks.push(Token { tok: Tok::Close, pos, spaced });
            return Ok((pos + len - start, trim));
        }
        let Some(c) = rest.chars().next() else {
            return Err(Fail(ErrorKind::UnclosedAction, open));
        };
        if is_space(c) {
            pos += 1;
            spaced = true;
            continue;
        }
        let (tok, len) = lex_token(rest, c).map_err(|kind| Fail(kind, pos))?;
        toks.push(Token { tok, pos, spaced });
        pos += len;
        spaced = false;
    }
}

/// One token at the start of `s` (whose first char is `c`): the token and its length in bytes.
fn lex_token(s: &str, c: char) -> Result<(Tok, usize), ErrorKind> {
    let after = &s[c.len_utf8()..];
    let word = |skip: usize| skip + after.find(|c: char| !is_alnum(c)).unwrap_or(after.len());
    Ok(match c {
        '(' => (Tok::LParen, 1),
        ')' => (Tok::RParen, 1),
        '|' => (Tok::Pipe, 1),
        ',' => (Tok::Comma, 1),
        '=' => (Tok::Assign, 1),
        ':' if after.starts_with('=') => (Tok::Declare, 2),
        '"' | '`' | '\'' => lex_quoted(s, c)?,
        '$' => {
            let n = word(1);
            (Tok::Var(s[..n].to_owned()), terminated(s, n)?)
        }
        '.' if !after.starts_with(|d: char| d.is_ascii_digit()) => {
            let n = word(1);
            let tok = if n == 1 { Tok::Dot } else { Tok::Field(s[1..n].to_owned()) };
            (tok, terminated(s, n)?)
        }
        '0'..='9' | '+' | '-' | '.' => {
            let n = number_len(s)?;
            (Tok::Lit(number(&s[..n])?), n)
        }
        c if is_alnum(c) => {
            let n = word(c.len_utf8());
            let tok = match &s[..n] {
                "true" => Tok::Lit(Value::Bool(true)),
                "false" => Tok::Lit(Value::Bool(false)),
                "nil" => Tok::Nil,
                w => Tok::Ident(w.to_owned()),
            };
            (tok, terminated(s, n)?)
        }
        c => return Err(syntax(format!("unrecognized character in action: {c:?}"))),
    })
}

/// Checks that the word of `n` bytes ends where Go's lexer lets a word end; returns `n`.
fn terminated(s: &str, n: usize) -> Result<usize, ErrorKind> {
    let rest = &s[n..];
    match rest.chars().next() {
        Some(c) if !is_space(c) && !".,|:()".contains(c) && !rest.starts_with("}}") => {
            Err(syntax(format!("bad character {c:?}")))
        }
        _ => Ok(n),
    }
}

/// The length of the number at the start of `s`, scanned as Go's lexer scans it.
fn number_len(s: &str) -> Result<usize, ErrorKind> {
    let b = s.as_bytes();
    let mut i = usize::from(matches!(b.first(), Some(b'+' | b'-')));
    let run = |i: &mut usize, set: &[u8]| {
        while b.get(*i).is_some_and(|c| set.contains(c)) {
            *i += 1;
        }
    };
    let mut digits: &[u8] = b"0123456789_";
    if b.get(i) == Some(&b'0') {
        i += 1;
        match b.get(i) {
            Some(b'x' | b'X') => digits = b"0123456789abcdefABCDEF_",
            Some(b'o' | b'O') => digits = b"01234567_",
            Some(b'b' | b'B') => digits = b"01_",
            _ => i -= 1,
        }
        i += 1;
    }
    run(&mut i, digits);
    if b.get(i) == Some(&b'.') {
        i += 1;
        run(&mut i, digits);
    }
    let exp: &[u8] = if digits.len() == 11 {
        b"eE"
    } else if digits.len() == 23 {
        b"pP"
    } else {
        b""
    };
    if b.get(i).is_some_and(|c| exp.contains(c)) {
        i += 1;
        run(&mut i, b"+-");
        run(&mut i, b"0123456789_");
    }
    run(&mut i, b"i");
    match s[i..].chars().next() {
        Some(c) if is_alnum(c) => Err(syntax(format!("bad number syntax: {:?}", &s[..i + c.len_utf8()]))),
        _ => Ok(i),
    }
}

/// The value of a number literal, typed as Go's template executor types an untyped constant:
/// int unless it is written as a float (with `.`, `e` or `p`).
fn number(text: &str) -> Result<Value, ErrorKind> {
    let illegal = || syntax(format!("illegal number syntax: {text:?}"));
    if text.ends_with('i') {
        return Err(syntax(format!("complex numbers are not supported: {text:?}")));
    }
    let (negative, body) = match text.as_bytes().first() {
        Some(b'-') => (true, &text[1..]),
        Some(b'+') => (false, &text[1..]),
        _ => (false, text),
    };
    let lower = body.to_ascii_lowercase();
    let (radix, digits) = match lower.get(..2) {
        Some("0x") => (16, &lower[2..]),
        Some("0o") => (8, &lower[2..]),
        Some("0b") => (2, &lower[2..]),
        _ if radix_float(&lower) => {
            let f: f64 = text.replace('_', "").parse().map_err(|_| illegal())?;
            return serde_json::Number::from_f64(f).map(Value::Number).ok_or_else(illegal);
        }
        _ if lower.len() > 1 && lower.starts_with('0') => (8, &lower[1..]),
        _ => (10, lower.as_str()),
    };
    let digits = digits.replace('_', "");
    if digits.is_empty() || digits.starts_with(['+', '-']) || radix_float(&lower) {
        return Err(illegal());
    }
    let n = i128::from_str_radix(&digits, radix).map_err(|_| illegal())?;
    let n = if negative { -n } else { n };
    i64::try_from(n).map(Value::from).map_err(|_| syntax(format!("{text} overflows int")))
}

/// Whether a literal is written as a float: `.`/`e` in decimal, `.`/`p` in hex.
fn radix_float(lower: &str) -> bool {
    if lower.starts_with("0x") { lower.contains(['.', 'p']) } else { lower.contains(['.', 'e']) }
}

/// A quoted string, raw string or character constant at the start of `s`.
fn lex_quoted(s: &str, q: char) -> Result<(Tok, usize), ErrorKind> {
    let body = &s[1..];
    if q == '`' {
        let end = body.find('`').ok_or_else(|| syntax("unterminated raw quoted string"))?;
        return Ok((Tok::Lit(Value::String(body[..end].replace('\r', ""))), end + 2));
    }
    let what = if q == '"' { "quoted string" } else { "character constant" };
    let unterminated = || syntax(format!("unterminated {what}"));
    let mut escaped = false;
    let mut end = None;
    for (i, c) in body.char_indices() {
        match c {
            '\n' => return Err(unterminated()),
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            c if c == q => {
                end = Some(i);
                break;
            }
            _ => {}
        }
    }
    let end = end.ok_or_else(unterminated)?;
    let units = unescape(&body[..end], q).ok_or_else(|| syntax(format!("invalid syntax in {what}")))?;
    let tok = if q == '"' {
        let mut bytes = Vec::new();
        for u in units {
            match u {
                Unit::Byte(b) => bytes.push(b),
                Unit::Char(c) => bytes.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
            }
        }
        Tok::Lit(Value::String(String::from_utf8_lossy(&bytes).into_owned()))
    } else {
        match units.as_slice() {
            [Unit::Byte(b)] => Tok::Lit(Value::from(*b)),
            [Unit::Char(c)] => Tok::Lit(Value::from(u32::from(*c))),
            _ => {
                return Err(syntax(format!("malformed character constant: {}", &s[..end + 2])));
            }
        }
    };
    Ok((tok, end + 2))
}

/// A decoded piece of a quoted literal: `\x` and octal escapes give raw bytes.
enum Unit {
    Byte(u8),
    Char(char),
}

/// Go's escapes in a string (`q` = `"`) or character constant (`q` = `'`).
fn unescape(s: &str, q: char) -> Option<Vec<Unit>> {
    let mut out = Vec::new();
    let mut it = s.chars();
    let hex = |it: &mut std::str::Chars, n: usize| {
        (0..n).try_fold(0u32, |v, _| Some(v * 16 + it.next()?.to_digit(16)?))
    };
    while let Some(c) = it.next() {
        if c != '\\' {
            out.push(Unit::Char(c));
            continue;
        }
        let e = it.next()?;
        out.push(match e {
            'a' => Unit::Char('\x07'),
            'b' => Unit::Char('\x08'),
            'f' => Unit::Char('\x0c'),
            'n' => Unit::Char('\n'),
            'r' => Unit::Char('\r'),
            't' => Unit::Char('\t'),
            'v' => Unit::Char('\x0b'),
            '\\' => Unit::Char('\\'),
            c if c == q => Unit::Char(c),
            'x' => Unit::Byte(u8::try_from(hex(&mut it, 2)?).ok()?),
            'u' => Unit::Char(char::from_u32(hex(&mut it, 4)?)?),
            'U' => Unit::Char(char::from_u32(hex(&mut it, 8)?)?),
            '0'..='7' => {
                let v = [Some(e), it.next(), it.next()]
                    .into_iter()
                    .try_fold(0u32, |v, d| Some(v * 8 + d?.to_digit(8)?))?;
                Unit::Byte(u8::try_from(v).ok()?)
            }
            _ => return None,
        });
    }
    Some(out)
}

// ---------------------------------------------------------------------------------------------
// Parse tree

#[derive(Debug, Clone)]
enum Node {
    Text(String),
    /// `{{pipeline}}`: printed unless it declares or assigns variables.
    Action(Pipe),
    /// `if`/`with` with its `else if`/`else with` chain, flattened.
    Cond(Cond),
    Range(Range),
    Break,
    Continue,
}

#[derive(Debug, Clone)]
struct Cond {
    with: bool,
    branches: Vec<(Pipe, Vec<Node>)>,
    otherwise: Vec<Node>,
}

#[derive(Debug, Clone)]
struct Range {
    pipe: Pipe,
    body: Vec<Node>,
    otherwise: Vec<Node>,
}

#[derive(Debug, Clone)]
struct Pipe {
    pos: usize,
    decl: Vec<String>,
    assign: bool,
    cmds: Vec<Cmd>,
}

#[derive(Debug, Clone)]
struct Cmd {
    pos: usize,
    args: Vec<Term>,
}

/// An operand; the `Vec<String>` parts are field chains (`.a.b`, `$x.a`, `(pipe).a`).
#[derive(Debug, Clone)]
enum Term {
    Dot,
    Nil,
    Lit(Value),
    Field(Vec<String>),
    Var(String, Vec<String>),
    Func(String),
    Sub(Box<Pipe>, Vec<String>),
}

// ---------------------------------------------------------------------------------------------
// Parser: tokens to tree, checking functions and variables as Go's parser does.

const KEYWORDS: [&str; 10] =
    ["block", "break", "continue", "define", "else", "end", "if", "range", "template", "with"];

/// How deep control structures and parentheses may nest.
const MAX_DEPTH: usize = 100;

/// Why a list of nodes ended.
enum Stop {
    Eof,
    End,
    Else,
}

enum Step {
    Node(Node),
    Stop(Stop),
}

struct Parser<'a> {
    toks: Vec<Token>,
    at: usize,
    funcs: &'a Functions,
    /// Variables in scope, innermost last; `$` always.
    vars: Vec<String>,
    range_depth: usize,
    depth: usize,
}

fn starts_operand(tok: &Tok) -> bool {
    matches!(
        tok,
        Tok::Dot | Tok::Nil | Tok::Lit(_) | Tok::Field(_) | Tok::Var(_) | Tok::Ident(_) | Tok::LParen
    )
}

fn describe(tok: &Tok) -> String {
    match tok {
        Tok::Text(_) => "text".into(),
        Tok::Open => "\"{{\"".into(),
        Tok::Close => "\"}}\"".into(),
        Tok::Field(n) => format!("<.{n}>"),
        Tok::Dot => "<.>".into(),
        Tok::Var(n) | Tok::Ident(n) => format!("<{n}>"),
        Tok::Lit(v) => format!("<{v}>"),
        Tok::Nil => "<nil>".into(),
        Tok::LParen => "\"(\"".into(),
        Tok::RParen => "\")\"".into(),
        Tok::Pipe => "\"|\"".into(),
        Tok::Declare => "\":=\"".into(),
        Tok::Assign => "\"=\"".into(),
        Tok::Comma => "\",\"".into(),
        Tok::Eof => "EOF".into(),
        Tok::Error(kind) => kind.to_string(),
    }
}

fn unexpected(t: &Token, context: &str) -> Fail {
    match &t.tok {
        Tok::Error(kind) => Fail(kind.clone(), t.pos),
        tok => Fail(ErrorKind::Unexpected(format!("{} in {context}", describe(tok))), t.pos),
    }
}

impl Parser<'_> {
    fn peek(&self) -> &Token {
        self.toks.get(self.at).unwrap_or(&EOF)
    }

    fn next(&mut self) -> Result<Token, Fail> {
        let t = self.peek().clone();
        self.at += 1;
        match t.tok {
            Tok::Error(kind) => Err(Fail(kind, t.pos)),
            _ => Ok(t),
        }
    }

    fn expect_close(&mut self, context: &str) -> Result<(), Fail> {
        let t = self.next()?;
        if t.tok == Tok::Close { Ok(()) } else { Err(unexpected(&t, context)) }
    }

    fn nest(&mut self, pos: usize) -> Result<(), Fail> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(Fail(syntax(format!("nesting deeper than {MAX_DEPTH} levels")), pos));
        }
        Ok(())
    }

    /// Nodes up to the end of input or an `{{end}}`/`{{else`; also the position of that stop.
    fn list(&mut self) -> Result<(Vec<Node>, Stop, usize), Fail> {
        let mut nodes = Vec::new();
        loop {
            let t = self.next()?;
            match t.tok {
                Tok::Text(s) => nodes.push(Node::Text(s)),
                Tok::Eof => return Ok((nodes, Stop::Eof, t.pos)),
                Tok::Open => match self.action(t.pos)? {
                    Step::Node(n) => nodes.push(n),
                    Step::Stop(stop) => return Ok((nodes, stop, t.pos)),
                },
                _ => return Err(unexpected(&t, "input")),
            }
        }
    }

    /// What follows an `{{`.
    fn action(&mut self, pos: usize) -> Result<Step, Fail> {
        let word = match &self.peek().tok {
            Tok::Ident(w) if KEYWORDS.contains(&w.as_str()) => w.clone(),
            _ => {
                let pipe = self.pipeline("command", false)?;
                self.expect_close("command")?;
                return Ok(Step::Node(Node::Action(pipe)));
            }
        };
        self.next()?;
        let node = match word.as_str() {
            "end" => {
                self.expect_close("end")?;
                return Ok(Step::Stop(Stop::End));
            }
            "else" => return Ok(Step::Stop(Stop::Else)),
            "if" | "with" => self.cond(word == "with", pos)?,
            "range" => self.range(pos)?,
            "break" | "continue" => {
                if self.range_depth == 0 {
                    return Err(Fail(syntax(format!("{{{{{word}}}}} outside {{{{range}}}}")), pos));
                }
                self.expect_close(&word)?;
                if word == "break" { Node::Break } else { Node::Continue }
            }
            _ => return Err(Fail(ErrorKind::Unsupported(word), pos)),
        };
        Ok(Step::Node(node))
    }

    fn cond(&mut self, with: bool, pos: usize) -> Result<Node, Fail> {
        let context = if with { "with" } else { "if" };
        self.nest(pos)?;
        let mark = self.vars.len();
        let mut branches = Vec::new();
        let otherwise = loop {
            let pipe = self.pipeline(context, false)?;
            self.expect_close(context)?;
            let (body, stop, _) = self.list()?;
            branches.push((pipe, body));
            match stop {
                Stop::End => break Vec::new(),
                Stop::Eof => return Err(Fail(ErrorKind::Unclosed(context), pos)),
                Stop::Else if matches!(&self.peek().tok, Tok::Ident(w) if w == context) => {
                    self.next()?;
                }
                Stop::Else => break self.else_tail(context, pos)?,
            }
        };
        self.vars.truncate(mark);
        self.depth -= 1;
        Ok(Node::Cond(Cond { with, branches, otherwise }))
    }

    fn range(&mut self, pos: usize) -> Result<Node, Fail> {
        self.nest(pos)?;
        let mark = self.vars.len();
        let pipe = self.pipeline("range", false)?;
        self.expect_close("range")?;
        self.range_depth += 1;
        let (body, stop, _) = self.list()?;
        self.range_depth -= 1;
        let otherwise = match stop {
            Stop::End => Vec::new(),
            Stop::Eof => return Err(Fail(ErrorKind::Unclosed("range"), pos)),
            Stop::Else => self.else_tail("range", pos)?,
        };
        self.vars.truncate(mark);
        self.depth -= 1;
        Ok(Node::Range(Range { pipe, body, otherwise }))
    }

    /// The rest of a plain `{{else}}`: its `}}` and the nodes up to `{{end}}`.
    fn else_tail(&mut self, context: &'static str, pos: usize) -> Result<Vec<Node>, Fail> {
        self.expect_close("else")?;
        let (nodes, stop, at) = self.list()?;
        match stop {
            Stop::End => Ok(nodes),
            Stop::Eof => Err(Fail(ErrorKind::Unclosed(context), pos)),
            Stop::Else => Err(Fail(syntax("expected end; found {{else}}"), at)),
        }
    }

    /// A pipeline up to `}}` (or `)` when `in_parens`), which is left unread.
    fn pipeline(&mut self, context: &str, in_parens: bool) -> Result<Pipe, Fail> {
        let pos = self.peek().pos;
        let (decl, assign) = self.declarations(context)?;
        let mut cmds = Vec::new();
        loop {
            let t = self.peek();
            match t.tok {
                Tok::Close if !in_parens => break,
                Tok::RParen if in_parens => break,
                Tok::Close => return Err(Fail(syntax("unclosed left paren"), t.pos)),
                Tok::RParen => return Err(Fail(syntax("unexpected right paren"), t.pos)),
                ref tok if starts_operand(tok) => cmds.push(self.command()?),
                _ => return Err(unexpected(t, context)),
            }
        }
        if cmds.is_empty() {
            return Err(Fail(syntax(format!("missing value for {context}")), pos));
        }
        let non_executable = |c: &Cmd| matches!(c.args.first(), Some(Term::Dot | Term::Nil | Term::Lit(_)));
        if let Some(i) = cmds.iter().skip(1).position(non_executable) {
            return Err(Fail(syntax(format!("non executable command in pipeline stage {}", i + 2)), pos));
        }
        if !assign {
            self.vars.extend(decl.iter().cloned());
        }
        Ok(Pipe { pos, decl, assign, cmds })
    }

    /// `$x :=`, `$x =`, or in a range `$i, $v :=`, at the start of a pipeline.
    fn declarations(&mut self, context: &str) -> Result<(Vec<String>, bool), Fail> {
        let pos = self.peek().pos;
        let ahead: Vec<&Tok> = self.toks.iter().skip(self.at).take(4).map(|t| &t.tok).collect();
        let (names, assign) = match ahead.as_slice() {
            [Tok::Var(a), op @ (Tok::Declare | Tok::Assign), ..] => (vec![a.clone()], **op == Tok::Assign),
            [Tok::Var(a), Tok::Comma, Tok::Var(b), op @ (Tok::Declare | Tok::Assign)]
                if context == "range" =>
            {
                (vec![a.clone(), b.clone()], **op == Tok::Assign)
            }
            [Tok::Var(_), Tok::Comma, ..] if context == "range" => {
                return Err(Fail(syntax("range can only initialize variables"), pos));
            }
            [Tok::Var(_), Tok::Comma, ..] => {
                return Err(Fail(syntax(format!("too many declarations in {context}")), pos));
            }
            _ => return Ok((Vec::new(), false)),
        };
        self.at += names.len() * 2;
        if let Some(undeclared) = names.iter().find(|n| assign && !self.vars.contains(n)) {
            return Err(Fail(ErrorKind::UndefinedVariable(undeclared.clone()), pos));
        }
        Ok((names, assign))
    }

    /// Space-separated operands up to `|`, `}}` or `)`.
    fn command(&mut self) -> Result<Cmd, Fail> {
        let pos = self.peek().pos;
        let mut args = vec![self.operand()?];
        loop {
            let t = self.peek();
            match t.tok {
                Tok::Close | Tok::RParen => break,
                Tok::Pipe => {
                    self.next()?;
                    break;
                }
                ref tok if t.spaced && starts_operand(tok) => args.push(self.operand()?),
                _ => return Err(unexpected(t, "operand")),
            }
        }
        Ok(Cmd { pos, args })
    }

    /// A term and the fields chained onto it without spaces.
    fn operand(&mut self) -> Result<Term, Fail> {
        let mut term = self.term()?;
        while let Token { tok: Tok::Field(name), pos, spaced: false } = self.peek() {
            let (name, pos) = (name.clone(), *pos);
            self.at += 1;
            term = match term {
                Term::Field(mut path) => {
                    path.push(name);
                    Term::Field(path)
                }
                Term::Var(var, mut path) => {
                    path.push(name);
                    Term::Var(var, path)
                }
                Term::Sub(pipe, mut path) => {
                    path.push(name);
                    Term::Sub(pipe, path)
                }
                Term::Func(f) => {
                    let call = Cmd { pos, args: vec![Term::Func(f)] };
                    Term::Sub(
                        Box::new(Pipe { pos, decl: Vec::new(), assign: false, cmds: vec![call] }),
                        vec![name],
                    )
                }
                Term::Dot | Term::Nil | Term::Lit(_) => {
                    return Err(Fail(syntax("unexpected . after term"), pos));
                }
            };
        }
        Ok(term)
    }

    fn term(&mut self) -> Result<Term, Fail> {
        let t = self.next()?;
        Ok(match t.tok {
            Tok::Dot => Term::Dot,
            Tok::Nil => Term::Nil,
            Tok::Lit(v) => Term::Lit(v),
            Tok::Field(name) => Term::Field(vec![name]),
            Tok::Var(name) if self.vars.contains(&name) => Term::Var(name, Vec::new()),
            Tok::Var(name) => return Err(Fail(ErrorKind::UndefinedVariable(name), t.pos)),
            Tok::Ident(name) if KEYWORDS.contains(&name.as_str()) => {
                return Err(Fail(ErrorKind::Unexpected(format!("<{name}> in operand")), t.pos));
            }
            Tok::Ident(name) if self.funcs.contains(&name) => Term::Func(name),
            Tok::Ident(name) => return Err(Fail(ErrorKind::UnknownFunction(name), t.pos)),
            Tok::LParen => {
                self.nest(t.pos)?;
                let pipe = self.pipeline("parenthesized pipeline", true)?;
                self.next()?;
                self.depth -= 1;
                Term::Sub(Box::new(pipe), Vec::new())
            }
            tok => {
                return Err(Fail(ErrorKind::Unexpected(format!("{} in operand", describe(&tok))), t.pos));
            }
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Template

/// A parsed template, ready to render any number of times.
#[derive(Debug, Clone)]
pub struct Template {
    name: String,
    source: String,
    root: Vec<Node>,
    funcs: Functions,
}

impl Template {
    /// Parses `text` with Go's builtin functions.
    pub fn parse(name: &str, text: &str) -> Result<Self, TemplateError> {
        Self::parse_with(name, text, Functions::default())
    }

    /// Parses `text`; it may call the functions in `funcs`.
    pub fn parse_with(name: &str, text: &str, funcs: Functions) -> Result<Self, TemplateError> {
        let mut parser = Parser {
            toks: lex(text),
            at: 0,
            funcs: &funcs,
            vars: vec!["$".into()],
            range_depth: 0,
            depth: 0,
        };
        let root = match parser.list() {
            Ok((nodes, Stop::Eof, _)) => Ok(nodes),
            Ok((_, Stop::End, pos)) => Err(Fail(ErrorKind::Unexpected("{{end}}".into()), pos)),
            Ok((_, Stop::Else, pos)) => Err(Fail(ErrorKind::Unexpected("{{else}}".into()), pos)),
            Err(fail) => Err(fail),
        }
        .map_err(|fail| TemplateError::new(name, text, fail, Phase::Parse))?;
        Ok(Template { name: name.to_owned(), source: text.to_owned(), root, funcs })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Renders with `data` as dot and `$`.
    pub fn render(&self, data: &Value) -> Result<String, TemplateError> {
        let root = Val::Json(data.clone());
        let mut exec =
            Exec { funcs: &self.funcs, vars: vec![("$".into(), root.clone())], out: String::new() };
        exec.walk(&root, &self.root)
            .map_err(|fail| TemplateError::new(&self.name, &self.source, fail, Phase::Exec))?;
        Ok(exec.out)
    }
}

// ---------------------------------------------------------------------------------------------
// Execution

/// A value while rendering: JSON data, or Go's "no value" (the invalid `reflect.Value` that a
/// missing key, `nil`, or a pipeline yielding a nil interface gives).
#[derive(Debug, Clone, PartialEq)]
enum Val {
    Missing,
    Json(Value),
}

impl Val {
    /// As passed to a function taking `interface{}`: "no value" becomes nil.
    fn into_value(self) -> Value {
        match self {
            Val::Missing => Value::Null,
            Val::Json(v) => v,
        }
    }
}

/// Go's truth: false, 0, nil, "no value" and empty strings, arrays and objects are false.
fn truth(v: &Val) -> bool {
    match v {
        Val::Missing | Val::Json(Value::Null) => false,
        Val::Json(Value::Bool(b)) => *b,
        Val::Json(Value::Number(n)) => n.as_f64().is_some_and(|f| f != 0.0),
        Val::Json(Value::String(s)) => !s.is_empty(),
        Val::Json(Value::Array(a)) => !a.is_empty(),
        Val::Json(Value::Object(m)) => !m.is_empty(),
    }
}

/// `.a.b` on `recv`: a missing key or "no value" gives "no value"; null or a non-object fails.
fn field_chain(recv: &Val, path: &[String], has_args: bool) -> Result<Val, ErrorKind> {
    let mut cur = match recv {
        Val::Missing => return Ok(Val::Missing),
        Val::Json(v) => v,
    };
    for (i, name) in path.iter().enumerate() {
        cur = match cur {
            Value::Object(_) if has_args && i + 1 == path.len() => {
                return Err(ErrorKind::Type(format!("{name} is not a method but has arguments")));
            }
            Value::Object(m) => match m.get(name) {
                Some(v) => v,
                None => return Ok(Val::Missing),
            },
            Value::Null => {
                return Err(ErrorKind::Type(format!("nil pointer evaluating interface {{}}.{name}")));
            }
            v => {
                return Err(ErrorKind::Type(format!("can't evaluate field {name} in type {}", go_type(v))));
            }
        };
    }
    Ok(Val::Json(cur.clone()))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flow {
    Normal,
    Break,
    Continue,
}

struct Exec<'t> {
    funcs: &'t Functions,
    /// Variables in scope, innermost last.
    vars: Vec<(String, Val)>,
    out: String,
}

impl Exec<'_> {
    fn walk(&mut self, dot: &Val, nodes: &[Node]) -> Result<Flow, Fail> {
        for node in nodes {
            let flow = match node {
                Node::Text(s) => {
                    self.out.push_str(s);
                    Flow::Normal
                }
                Node::Action(pipe) => {
                    let v = self.pipe(dot, pipe)?;
                    if pipe.decl.is_empty() {
                        match v {
                            Val::Missing => self.out.push_str("<no value>"),
                            Val::Json(v) => format::write_v(&mut self.out, &v),
                        }
                    }
                    Flow::Normal
                }
                Node::Cond(cond) => self.cond(dot, cond)?,
                Node::Range(range) => self.range(dot, range)?,
                Node::Break => Flow::Break,
                Node::Continue => Flow::Continue,
            };
            if flow != Flow::Normal {
                return Ok(flow);
            }
        }
        Ok(Flow::Normal)
    }

    fn cond(&mut self, dot: &Val, cond: &Cond) -> Result<Flow, Fail> {
        let mark = self.vars.len();
        let mut flow = None;
        for (pipe, body) in &cond.branches {
            let v = self.pipe(dot, pipe)?;
            if truth(&v) {
                flow = Some(if cond.with { self.walk(&v, body)? } else { self.walk(dot, body)? });
                break;
            }
        }
        let flow = match flow {
            Some(flow) => flow,
            None => self.walk(dot, &cond.otherwise)?,
        };
        self.vars.truncate(mark);
        Ok(flow)
    }

    fn range(&mut self, dot: &Val, range: &Range) -> Result<Flow, Fail> {
        let pipe = &range.pipe;
        let type_err = |message: String| Fail(ErrorKind::Type(message), pipe.pos);
        let mark = self.vars.len();
        let value = self.pipe(dot, pipe)?;
        let inner = self.vars.len();
        let mut keys: Vec<&String> = Vec::new();
        let count = match &value {
            Val::Missing => 0,
            Val::Json(Value::Array(a)) => a.len(),
            Val::Json(Value::Object(m)) => {
                keys = m.keys().collect();
                keys.sort();
                m.len()
            }
            Val::Json(Value::Number(n)) if n.is_i64() || n.is_u64() => {
                if pipe.decl.len() > 1 {
                    return Err(type_err(format!("can't use {n} to iterate over more than one variable")));
                }
                n.as_u64().and_then(|n| usize::try_from(n).ok()).unwrap_or(0)
            }
            Val::Json(v) => {
                let mut shown = String::new();
                format::write_v(&mut shown, v);
                return Err(type_err(format!("range can't iterate over {shown}")));
            }
        };
        if count == 0 {
            let flow = self.walk(dot, &range.otherwise)?;
            self.vars.truncate(mark);
            return Ok(flow);
        }
        for i in 0..count {
            let (key, elem) = match &value {
                Val::Json(Value::Array(a)) => (Value::from(i), a.get(i).cloned().unwrap_or_default()),
                Val::Json(Value::Object(m)) => {
                    let key = keys.get(i).map_or_else(String::new, |k| (*k).clone());
                    let elem = m.get(&key).cloned().unwrap_or_default();
                    (Value::String(key), elem)
                }
                _ => (Value::from(i), Value::from(i)),
            };
            let elem = Val::Json(elem);
            match pipe.decl.as_slice() {
                [v] => self.bind(v, elem.clone(), pipe.assign, pipe.pos)?,
                [k, v] => {
                    self.bind(k, Val::Json(key), pipe.assign, pipe.pos)?;
                    self.bind(v, elem.clone(), pipe.assign, pipe.pos)?;
                }
                _ => {}
            }
            let flow = self.walk(&elem, &range.body)?;
            self.vars.truncate(inner);
            if flow == Flow::Break {
                break;
            }
        }
        self.vars.truncate(mark);
        Ok(Flow::Normal)
    }

    /// Declares (`:=`) or assigns (`=`) a variable.
    fn bind(&mut self, name: &str, v: Val, assign: bool, pos: usize) -> Result<(), Fail> {
        if !assign {
            self.vars.push((name.to_owned(), v));
            return Ok(());
        }
        let slot = self.vars.iter_mut().rev().find(|(n, _)| n == name);
        let slot = slot.ok_or_else(|| Fail(ErrorKind::UndefinedVariable(name.to_owned()), pos))?;
        slot.1 = v;
        Ok(())
    }

    fn var(&self, name: &str, pos: usize) -> Result<&Val, Fail> {
        let found = self.vars.iter().rev().find(|(n, _)| n == name);
        found.map(|(_, v)| v).ok_or_else(|| Fail(ErrorKind::UndefinedVariable(name.to_owned()), pos))
    }

    /// Runs a pipeline and binds its declared variables.
    fn pipe(&mut self, dot: &Val, pipe: &Pipe) -> Result<Val, Fail> {
        let mut last = None;
        for cmd in &pipe.cmds {
            let v = self.command(dot, cmd, last.take())?;
            // Go digs into a result of type interface{}: a nil one becomes "no value".
            last = Some(if v == Val::Json(Value::Null) { Val::Missing } else { v });
        }
        let v = last.unwrap_or(Val::Missing);
        for name in &pipe.decl {
            self.bind(name, v.clone(), pipe.assign, pipe.pos)?;
        }
        Ok(v)
    }

    /// One command; `fin` is the previous command's value, passed as the last argument.
    fn command(&mut self, dot: &Val, cmd: &Cmd, fin: Option<Val>) -> Result<Val, Fail> {
        let at = |kind| Fail(kind, cmd.pos);
        let Some((head, rest)) = cmd.args.split_first() else {
            return Err(at(syntax("empty command")));
        };
        let has_args = !rest.is_empty() || fin.is_some();
        match head {
            Term::Func(name) => self.call(dot, name, rest, fin, cmd.pos),
            Term::Field(path) => field_chain(dot, path, has_args).map_err(at),
            Term::Var(name, path) if !path.is_empty() => {
                field_chain(self.var(name, cmd.pos)?, path, has_args).map_err(at)
            }
            Term::Sub(pipe, path) if !path.is_empty() => {
                let v = self.pipe(dot, pipe)?;
                field_chain(&v, path, has_args).map_err(at)
            }
            _ if has_args => Err(at(ErrorKind::Type("can't give argument to non-function".into()))),
            Term::Nil => Err(at(ErrorKind::Type("nil is not a command".into()))),
            term => self.arg(dot, term, cmd.pos),
        }
    }

    /// An operand's value as a function argument.
    fn arg(&mut self, dot: &Val, term: &Term, pos: usize) -> Result<Val, Fail> {
        let at = |kind| Fail(kind, pos);
        match term {
            Term::Dot => Ok(dot.clone()),
            Term::Nil => Ok(Val::Missing),
            Term::Lit(v) => Ok(Val::Json(v.clone())),
            Term::Field(path) => field_chain(dot, path, false).map_err(at),
            Term::Var(name, path) if path.is_empty() => self.var(name, pos).cloned(),
            Term::Var(name, path) => field_chain(self.var(name, pos)?, path, false).map_err(at),
            Term::Func(name) => self.call(dot, name, &[], None, pos),
            Term::Sub(pipe, path) => {
                let v = self.pipe(dot, pipe)?;
                if path.is_empty() { Ok(v) } else { field_chain(&v, path, false).map_err(at) }
            }
        }
    }

    fn call(
        &mut self,
        dot: &Val,
        name: &str,
        args: &[Term],
        fin: Option<Val>,
        pos: usize,
    ) -> Result<Val, Fail> {
        let at = |kind| Fail(kind, pos);
        let func = self.funcs.map.get(name).ok_or_else(|| at(ErrorKind::UnknownFunction(name.into())))?;
        let arity = match func {
            Func::Builtin(b) => b.arity(),
            Func::Custom(arity, _) => *arity,
        };
        let got = args.len() + usize::from(fin.is_some());
        if !arity.accepts(got) {
            return Err(at(ErrorKind::ArgCount { func: name.into(), want: arity, got }));
        }
        if let Func::Builtin(b @ (Builtin::And | Builtin::Or)) = func {
            // Short-circuit: the first argument that decides is the result.
            let decides = *b == Builtin::Or;
            let mut last = Val::Missing;
            for a in args {
                last = self.arg(dot, a, pos)?;
                if truth(&last) == decides {
                    return Ok(last);
                }
            }
            return Ok(fin.unwrap_or(last));
        }
        let mut vals = Vec::with_capacity(got);
        for a in args {
            vals.push(self.arg(dot, a, pos)?);
        }
        vals.extend(fin);
        match func {
            Func::Builtin(b) => builtin(*b, name, vals).map_err(at),
            Func::Custom(_, f) => {
                let plain: Vec<Value> = vals.into_iter().map(Val::into_value).collect();
                f(&plain).map(Val::Json).map_err(|message| at(call_err(name, message)))
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Builtins other than and/or

fn builtin(b: Builtin, name: &str, args: Vec<Val>) -> Result<Val, ErrorKind> {
    let string = |s: String| Ok(Val::Json(Value::String(s)));
    match b {
        Builtin::Index => return index(args),
        Builtin::Print
        | Builtin::Println
        | Builtin::Printf
        | Builtin::Js
        | Builtin::Html
        | Builtin::Urlquery => {
            let vals: Vec<Value> = args.into_iter().map(Val::into_value).collect();
            return match (b, vals.as_slice()) {
                (Builtin::Print, _) => string(format::sprint(&vals)),
                (Builtin::Println, _) => string(format::sprintln(&vals)),
                (Builtin::Printf, [Value::String(f), rest @ ..]) => string(format::sprintf(f, rest)),
                (Builtin::Printf, [Value::Null, ..]) => {
                    Err(ErrorKind::Type("invalid value; expected string".into()))
                }
                (Builtin::Printf, [v, ..]) => {
                    Err(ErrorKind::Type(format!("wrong type for value; expected string; got {}", go_type(v))))
                }
                (Builtin::Js, _) => string(format::js_escape(&format::eval_args(&vals))),
                (Builtin::Html, _) => string(format::html_escape(&format::eval_args(&vals))),
                _ => string(format::url_query_escape(&format::eval_args(&vals))),
            };
        }
        _ => {}
    }
    let fail = |message: String| call_err(name, message);
    let boolean = |b: bool| Ok(Val::Json(Value::Bool(b)));
    match (b, args.as_slice()) {
        (Builtin::Not, [a]) => boolean(!truth(a)),
        (Builtin::Len, [a]) => length(a).map(|n| Val::Json(n.into())).map_err(fail),
        (Builtin::Eq, [a, rest @ ..]) => boolean(eq(a, rest).map_err(fail)?),
        (Builtin::Ne, [x, y]) => boolean(!eq(x, std::slice::from_ref(y)).map_err(fail)?),
        (Builtin::Lt, [x, y]) => boolean(lt(x, y).map_err(fail)?),
        (Builtin::Ge, [x, y]) => boolean(!lt(x, y).map_err(fail)?),
        (Builtin::Le | Builtin::Gt, [x, y]) => {
            let le = lt(x, y).map_err(fail)? || eq(x, std::slice::from_ref(y)).map_err(fail)?;
            boolean(le == (b == Builtin::Le))
        }
        _ => Err(fail(format!("internal error: bad call of {name}"))),
    }
}

fn length(v: &Val) -> Result<usize, String> {
    match v {
        Val::Missing | Val::Json(Value::Null) => Err("len of nil pointer".into()),
        Val::Json(Value::String(s)) => Ok(s.len()),
        Val::Json(Value::Array(a)) => Ok(a.len()),
        Val::Json(Value::Object(m)) => Ok(m.len()),
        Val::Json(v) => Err(format!("len of type {}", go_type(v))),
    }
}

/// `index x 1 "k"`: x[1]["k"]; a missing key gives nil, a string gives a byte.
fn index(args: Vec<Val>) -> Result<Val, ErrorKind> {
    let fail = |message: String| call_err("index", message);
    let mut it = args.into_iter();
    let mut cur = match it.next() {
        Some(Val::Json(v)) if !v.is_null() => v,
        _ => return Err(fail("index of untyped nil".into())),
    };
    for idx in it {
        cur = match cur {
            Value::Array(mut a) => {
                let i = index_arg(&idx, a.len())?;
                a.swap_remove(i)
            }
            Value::String(s) => {
                let i = index_arg(&idx, s.len())?;
                Value::from(s.as_bytes().get(i).copied().unwrap_or(0))
            }
            Value::Object(mut m) => match idx {
                Val::Json(Value::String(k)) => m.remove(&k).unwrap_or(Value::Null),
                Val::Missing | Val::Json(Value::Null) => {
                    return Err(fail("value is nil; should be of type string".into()));
                }
                Val::Json(v) => {
                    return Err(fail(format!("value has type {}; should be string", go_type(&v))));
                }
            },
            Value::Null => return Err(fail("index of nil pointer".into())),
            v => return Err(fail(format!("can't index item of type {}", go_type(&v)))),
        };
    }
    Ok(Val::Json(cur))
}

fn index_arg(idx: &Val, len: usize) -> Result<usize, ErrorKind> {
    match idx {
        Val::Json(Value::Number(n)) if n.is_i64() || n.is_u64() => {
            let x = n.as_i64().map(i128::from).or_else(|| n.as_u64().map(i128::from)).unwrap_or(-1);
            usize::try_from(x).ok().filter(|&i| i < len).ok_or(ErrorKind::IndexOutOfRange(x))
        }
        Val::Missing | Val::Json(Value::Null) => Err(call_err("index", "cannot index slice/array with nil")),
        Val::Json(v) => Err(call_err("index", format!("cannot index slice/array with type {}", go_type(v)))),
    }
}

/// A value of one of Go's basic kinds, as the comparison builtins see it.
enum Basic<'v> {
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(&'v str),
}

fn basic(v: &Val) -> Option<Basic<'_>> {
    match v {
        Val::Json(Value::Bool(b)) => Some(Basic::Bool(*b)),
        Val::Json(Value::Number(n)) => {
            Some(match n.as_i64().map(i128::from).or_else(|| n.as_u64().map(i128::from)) {
                Some(i) => Basic::Int(i),
                None => Basic::Float(n.as_f64().unwrap_or(0.0)),
            })
        }
        Val::Json(Value::String(s)) => Some(Basic::Str(s)),
        _ => None,
    }
}

fn is_nil(v: &Val) -> bool {
    matches!(v, Val::Missing | Val::Json(Value::Null))
}

fn type_name(v: &Val) -> &'static str {
    match v {
        Val::Missing => "<nil>",
        Val::Json(v) => go_type(v),
    }
}

fn incompatible(a: &Val, b: &Val) -> String {
    format!("incompatible types for comparison: {} and {}", type_name(a), type_name(b))
}

/// `eq a b c`: a == b || a == c. Ints and floats don't compare with each other, as in Go.
fn eq(a: &Val, others: &[Val]) -> Result<bool, String> {
    if others.is_empty() {
        return Err("missing argument for comparison".into());
    }
    for b in others {
        let equal = match (basic(a), basic(b)) {
            (Some(Basic::Bool(x)), Some(Basic::Bool(y))) => x == y,
            (Some(Basic::Int(x)), Some(Basic::Int(y))) => x == y,
            (Some(Basic::Float(x)), Some(Basic::Float(y))) => x == y,
            (Some(Basic::Str(x)), Some(Basic::Str(y))) => x == y,
            (Some(_), Some(_)) => return Err(incompatible(a, b)),
            _ if is_nil(a) || is_nil(b) => is_nil(a) && is_nil(b),
            (None, None) => return Err(format!("non-comparable type {}", type_name(b))),
            _ => return Err(incompatible(a, b)),
        };
        if equal {
            return Ok(true);
        }
    }
    Ok(false)
}

fn lt(a: &Val, b: &Val) -> Result<bool, String> {
    match (basic(a), basic(b)) {
        (None, _) | (_, None) | (Some(Basic::Bool(_)), Some(Basic::Bool(_))) => {
            Err("invalid type for comparison".into())
        }
        (Some(Basic::Int(x)), Some(Basic::Int(y))) => Ok(x < y),
        (Some(Basic::Float(x)), Some(Basic::Float(y))) => Ok(x < y),
        (Some(Basic::Str(x)), Some(Basic::Str(y))) => Ok(x < y),
        _ => Err(incompatible(a, b)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn funcs() -> Functions {
        Functions::default().with_istio()
    }

    fn render(text: &str, data: Value) -> String {
        let t = Template::parse_with("t", text, funcs()).unwrap_or_else(|e| panic!("{text}: {e}"));
        t.render(&data).unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    fn parse_err(text: &str) -> TemplateError {
        Template::parse_with("t", text, funcs()).expect_err(text)
    }

    fn exec_err(text: &str, data: Value) -> TemplateError {
        let t = Template::parse_with("t", text, funcs()).unwrap_or_else(|e| panic!("{text}: {e}"));
        t.render(&data).expect_err(text)
    }

    fn data() -> Value {
        json!({
            "s": "hello", "i": 42, "f": 1.5, "t": true, "null": null,
            "xs": [10, 11, 12], "m": {"b": 2, "a": 1, "c": 3}, "empty": [], "eobj": {},
            "nested": [{"k": "v"}], "name": "root"
        })
    }

    #[test]
    fn fields_root_and_dot() {
        assert_eq!(
            render("{{.s}} {{.m.a}} {{$.name}} {{with .m}}{{.b}}{{$.s}}{{end}}", data()),
            "hello 1 root 2hello"
        );
    }

    #[test]
    fn prints_values_as_go() {
        let d = json!({"arr": ["a", 1, null, true, 2.5], "obj": {"b": 2, "a": [1]}, "e": {}, "n": null});
        assert_eq!(
            render("{{.arr}}|{{.obj}}|{{.e}}|{{.missing}}|{{.n}}|{{print .n}}", d),
            "[a 1 <nil> true 2.5]|map[a:[1] b:2]|map[]|<no value>|<no value>|<nil>"
        );
        let floats = json!([1.5, 1e21, 1e-5, 1000000.0, 123456.0, 100.0, -0.5, 0.0001, 123456789.0, 0.0]);
        assert_eq!(
            render("{{range .}}{{.}} {{end}}", floats),
            "1.5 1e+21 1e-05 1e+06 123456 100 -0.5 0.0001 1.23456789e+08 0 "
        );
        assert_eq!(
            render("{{.i}} {{.t}} {{.u}}", json!({"i": -7, "t": false, "u": u64::MAX})),
            "-7 false 18446744073709551615"
        );
    }

    #[test]
    fn missing_keys_and_nil_fields() {
        assert_eq!(
            render("{{.a.b.c}}|{{if .a}}y{{else}}n{{end}}|{{with .a}}y{{else}}n{{end}}", json!({})),
            "<no value>|n|n"
        );
        assert_eq!(
            exec_err("{{.n.x}}", json!({"n": null})).kind,
            ErrorKind::Type("nil pointer evaluating interface {}.x".into())
        );
        assert_eq!(
            exec_err("{{.s.x}}", data()).kind,
            ErrorKind::Type("can't evaluate field x in type string".into())
        );
        assert_eq!(render("{{(.n).x}}", json!({"n": null})), "<no value>");
    }

    #[test]
    fn truth() {
        let d = json!({"z": 0, "zf": 0.0, "es": "", "ea": [], "eo": {}, "n": null, "f": false, "one": 1, "s": "x", "a": [0], "o": {"k": 0}});
        let t = "{{range $k := .keys}}{{if index $.d $k}}T{{else}}F{{end}}{{end}}";
        let keys = json!(["z", "zf", "es", "ea", "eo", "n", "f", "missing", "one", "s", "a", "o"]);
        assert_eq!(render(t, json!({"keys": keys, "d": d})), "FFFFFFFFTTTT");
    }

    #[test]
    fn trim_markers() {
        assert_eq!(render("a  \n {{- .s -}} \n\t b", data()), "ahellob");
        assert_eq!(render("a {{- .s}} b {{.s -}} c", data()), "ahello b helloc");
        assert_eq!(render("a \n{{- /* note */ -}}\n b", data()), "ab");
        assert_eq!(render("a {{/* note */ -}} b {{- /* note */}} c", data()), "a b c");
        assert_eq!(render("{{-3}} {{3 -}} x", data()), "-3 3x");
        assert_eq!(render("{{- .s}}", data()), "hello");
    }

    #[test]
    fn comments() {
        assert_eq!(render("a{{/* x {{ }} */}}b", data()), "ab");
        assert_eq!(parse_err("a{{/* x").kind, ErrorKind::UnclosedComment);
        assert_eq!(parse_err("{{/* x */ }}").kind, syntax("comment ends before closing delimiter"));
    }

    #[test]
    fn if_else_chains() {
        let t = "{{if .a}}A{{else if .b}}B{{else if .c}}C{{else}}D{{end}}";
        assert_eq!(render(t, json!({"a": 1, "b": 1})), "A");
        assert_eq!(render(t, json!({"b": "x", "c": 1})), "B");
        assert_eq!(render(t, json!({"c": [1]})), "C");
        assert_eq!(render(t, json!({})), "D");
        assert_eq!(render("{{if .a}}A{{else if .b}}B{{end}}", json!({})), "");
        let with = "{{with .a}}a{{.}}{{else with .b}}b{{.}}{{else}}none{{end}}";
        assert_eq!(render(with, json!({"b": 2})), "b2");
        assert_eq!(render(with, json!({})), "none");
        assert!(matches!(parse_err("{{if 1}}{{else with 2}}{{end}}").kind, ErrorKind::Unexpected(_)));
        assert_eq!(parse_err("{{if 1}}{{else}}{{else}}{{end}}").kind, syntax("expected end; found {{else}}"));
    }

    #[test]
    fn range_arrays_objects_ints() {
        let d = data();
        assert_eq!(render("{{range .xs}}[{{.}}]{{end}}", d.clone()), "[10][11][12]");
        assert_eq!(render("{{range $i, $v := .xs}}{{$i}}={{$v}},{{end}}", d.clone()), "0=10,1=11,2=12,");
        assert_eq!(render("{{range $v := .xs}}{{$v}}{{end}}", d.clone()), "101112");
        assert_eq!(render("{{range $k, $v := .m}}{{$k}}:{{$v}} {{end}}", d.clone()), "a:1 b:2 c:3 ");
        assert_eq!(render("{{range .m}}{{.}}{{end}}|{{range $v := .m}}{{$v}}{{end}}", d.clone()), "123|123");
        let empty = "{{range .x}}item{{else}}empty{{end}}";
        for x in [json!([]), json!({}), json!(null), json!(0)] {
            assert_eq!(render(empty, json!({"x": x})), "empty");
        }
        assert_eq!(render(empty, json!({})), "empty");
        assert_eq!(render("{{range 3}}{{.}}{{end}}", d.clone()), "012");
        assert_eq!(
            exec_err("{{range $i, $v := 3}}{{end}}", d.clone()).kind,
            ErrorKind::Type("can't use 3 to iterate over more than one variable".into())
        );
        assert_eq!(
            exec_err("{{range .s}}{{end}}", d.clone()).kind,
            ErrorKind::Type("range can't iterate over hello".into())
        );
        assert_eq!(render("{{range .nested}}{{.k}}{{$.name}}{{end}}", d), "vroot");
    }

    #[test]
    fn break_and_continue() {
        let t = "{{range .}}{{if eq . 3}}{{break}}{{end}}{{if eq . 1}}{{continue}}{{end}}{{.}}{{end}}";
        assert_eq!(render(t, json!([0, 1, 2, 3, 4])), "02");
        let nested = "{{range .}}{{range .}}{{if eq . 2}}{{break}}{{end}}{{.}}{{end}};{{end}}";
        assert_eq!(render(nested, json!([[1, 2, 3], [4]])), "1;4;");
        assert_eq!(parse_err("{{break}}").kind, syntax("{{break}} outside {{range}}"));
        assert_eq!(
            parse_err("{{range .}}{{else}}{{continue}}{{end}}").kind,
            syntax("{{continue}} outside {{range}}")
        );
    }

    #[test]
    fn variable_scopes() {
        assert_eq!(render("{{$x := 1}}{{if true}}{{$x := 2}}{{$x}}{{end}}{{$x}}", json!({})), "21");
        assert_eq!(render("{{$x := 1}}{{if true}}{{$x = 2}}{{end}}{{$x}}", json!({})), "2");
        assert_eq!(render("{{$v := \"out\"}}{{range $v := .}}{{$v}}{{end}}{{$v}}", json!([1, 2])), "12out");
        assert_eq!(render("{{if $x := .a}}{{$x}}{{else}}{{$x}}!{{end}}", json!({"a": 0})), "0!");
        assert_eq!(render("{{with $x := .a}}{{$x.b}}{{.b}}{{end}}", json!({"a": {"b": 7}})), "77");
        assert_eq!(render("{{$i := 0}}{{range .}}{{$i = .}}{{end}}{{$i}}", json!([4, 5])), "5");
        assert_eq!(
            parse_err("{{if true}}{{$y := 1}}{{end}}{{$y}}").kind,
            ErrorKind::UndefinedVariable("$y".into())
        );
        assert_eq!(parse_err("{{$z = 1}}").kind, ErrorKind::UndefinedVariable("$z".into()));
        assert_eq!(parse_err("{{$a, $b := 1}}").kind, syntax("too many declarations in command"));
        assert_eq!(
            parse_err("{{range $a, 1 := .}}{{end}}").kind,
            syntax("range can only initialize variables")
        );
    }

    #[test]
    fn scopes_across_else_and_break_through_with() {
        let t =
            "{{with $x := .a}}{{$x}}{{else}}[{{$x}}]{{end}}|{{range $i, $e := .e}}{{else}}{{len $i}}{{end}}";
        assert_eq!(render(t, json!({"a": "", "e": []})), "[]|0");
        let t = "{{range .}}{{with .}}{{if eq . 2}}{{break}}{{end}}{{.}}{{end}}{{end}}";
        assert_eq!(render(t, json!([1, 0, 2, 3])), "1");
        assert_eq!(render("{{$ = 5}}{{$}}", json!({})), "5");
    }

    #[test]
    fn and_or_return_deciding_value() {
        let d = json!({"a": 0, "b": "bee", "xs": [1]});
        assert_eq!(
            render("{{or .a .b \"c\"}}|{{and 1 0 2}}|{{and 1 2}}|{{or 0 \"\"}}|{{or .missing}}", d.clone()),
            "bee|0|2||<no value>"
        );
        assert_eq!(render("{{or 1 (index .xs 10)}}|{{and 0 (index .xs 10)}}", d.clone()), "1|0");
        assert_eq!(render("{{.a | or .b}}|{{.b | and 1}}|{{0 | or false}}", d), "bee|bee|0");
        assert_eq!(render("{{not 0}} {{not .xs}} {{not nil}}", json!({"xs": [1]})), "true false true");
    }

    #[test]
    fn comparisons() {
        assert_eq!(
            render(
                "{{eq 1 2 3 1}} {{eq \"a\" \"b\"}} {{ne 1 2}} {{eq .x nil}} {{eq .s nil}}",
                json!({"s": "x"})
            ),
            "true false true true false"
        );
        assert_eq!(
            render("{{lt 1 2}} {{le 2 2}} {{gt \"b\" \"a\"}} {{ge 1 2}} {{lt 1.5 2.5}}", json!({})),
            "true true true false true"
        );
        assert_eq!(
            exec_err("{{eq 1 1.0}}", json!({})).kind,
            call_err("eq", "incompatible types for comparison: int and float64")
        );
        assert_eq!(
            exec_err("{{lt true false}}", json!({})).kind,
            call_err("lt", "invalid type for comparison")
        );
        assert_eq!(exec_err("{{eq 1}}", json!({})).kind, call_err("eq", "missing argument for comparison"));
        assert_eq!(
            exec_err("{{eq .a .a}}", json!({"a": [1]})).kind,
            call_err("eq", "non-comparable type []interface {}")
        );
    }

    #[test]
    fn len_and_index() {
        let d = data();
        assert_eq!(render("{{len .xs}} {{len .s}} {{len .m}} {{len \"é\"}}", d.clone()), "3 5 3 2");
        assert_eq!(
            render(
                "{{index .xs 1}} {{index .m \"a\"}} {{index .nested 0 \"k\"}} {{index .m \"zz\"}} {{index .s 0}} {{index .xs}}",
                d.clone()
            ),
            "11 1 v <no value> 104 [10 11 12]"
        );
        assert_eq!(exec_err("{{index .xs 5}}", d.clone()).kind, ErrorKind::IndexOutOfRange(5));
        assert_eq!(exec_err("{{index .xs -1}}", d.clone()).kind, ErrorKind::IndexOutOfRange(-1));
        assert_eq!(
            exec_err("{{index .xs \"a\"}}", d.clone()).kind,
            call_err("index", "cannot index slice/array with type string")
        );
        assert_eq!(
            exec_err("{{index .i 0}}", d.clone()).kind,
            call_err("index", "can't index item of type int")
        );
        assert_eq!(exec_err("{{len .i}}", d).kind, call_err("len", "len of type int"));
    }

    #[test]
    fn print_functions() {
        assert_eq!(
            render("{{print 1 2 \"a\" \"b\" 3 .missing}}|{{println 1 \"a\"}}", json!({})),
            "1 2ab3 <nil>|1 a\n"
        );
        let t = r#"{{printf "%s-%d-%v-%q-%t-%%" "x" 42 1.5 "q\"" true}}"#;
        assert_eq!(render(t, json!({})), r#"x-42-1.5-"q\""-true-%"#);
        let t = r#"{{printf "%5d|%-5s|%05.1f|%x|%X|%e|%g|%+d|%.2s|%c|%o" 42 "ab" 3.14159 255 "hi" 1234.5678 0.00001 3 "xyz" 65 8}}"#;
        assert_eq!(render(t, json!({})), "   42|ab   |003.1|ff|6869|1.234568e+03|1e-05|+3|xy|A|10");
        assert_eq!(
            render(
                r#"{{printf "%d"}}|{{printf "%d" "x"}}|{{printf "%s" 1 2}}|{{printf "%v %d" .m .xs}}"#,
                data()
            ),
            "%!d(MISSING)|%!d(string=x)|%!s(int=1)%!(EXTRA int=2)|map[a:1 b:2 c:3] [10 11 12]"
        );
        assert_eq!(
            render(r#"{{printf "%v|%s|%q" .missing .n "\u00e9\x01"}}"#, json!({"n": null})),
            "<nil>|%!s(<nil>)|\"é\\x01\""
        );
        assert_eq!(render(r#"{{"x" | printf "%s-%s" "a"}}"#, json!({})), "a-x");
        assert_eq!(
            exec_err("{{printf 1}}", json!({})).kind,
            ErrorKind::Type("wrong type for value; expected string; got int".into())
        );
    }

    #[test]
    fn js_escapes_each_special_character() {
        let cases = [
            ("\\", "\\\\"),
            ("'", "\\'"),
            ("\"", "\\\""),
            ("<", "\\u003C"),
            (">", "\\u003E"),
            ("&", "\\u0026"),
            ("=", "\\u003D"),
            ("\n", "\\u000A"),
            ("\t", "\\u0009"),
            ("\u{1}", "\\u0001"),
            ("\u{1f}", "\\u001F"),
            ("\u{7f}", "\u{7f}"),
            ("é", "é"),
            ("日本", "日本"),
            ("\u{2028}", "\\u2028"),
            ("\u{a0}", "\\u00A0"),
            ("\u{ad}", "\\u00AD"),
            ("\u{feff}", "\\uFEFF"),
            ("\u{85}", "\\u0085"),
            ("a b/c:d", "a b/c:d"),
        ];
        for (input, want) in cases {
            assert_eq!(render("{{js .}}", json!(input)), want, "js of {input:?}");
        }
        assert_eq!(
            render("{{js .missing}}|{{js 1 2}}|{{.s | js}}", json!({"s": "a'b"})),
            "\\u003Cno value\\u003E|1 2|a\\'b"
        );
    }

    #[test]
    fn html_and_urlquery() {
        assert_eq!(
            render("{{html .}}", json!("<a href='x'>\"&\"</a>\u{0}")),
            "&lt;a href=&#39;x&#39;&gt;&#34;&amp;&#34;&lt;/a&gt;\u{FFFD}"
        );
        assert_eq!(
            render("{{html nil}}|{{urlquery \"a b&c=d/é~\"}}", json!({})),
            "&lt;no value&gt;|a+b%26c%3Dd%2F%C3%A9~"
        );
    }

    #[test]
    fn literals() {
        assert_eq!(
            render(r#"{{"a\tb\u00e9\x41\101\\"}}|{{`raw\n`}}|{{'a'}} {{'\n'}} {{'é'}}"#, json!({})),
            "a\tbéAA\\|raw\\n|97 10 233"
        );
        assert_eq!(
            render(
                "{{0x1F}} {{0o17}} {{017}} {{0b101}} {{1_000}} {{1e3}} {{1.0}} {{-2}} {{+3}} {{.5}} {{true}}",
                json!({})
            ),
            "31 15 15 5 1000 1000 1 -2 3 0.5 true"
        );
        assert_eq!(exec_err("{{nil}}", json!({})).kind, ErrorKind::Type("nil is not a command".into()));
        assert_eq!(parse_err("{{1x}}").kind, syntax("bad number syntax: \"1x\""));
        assert_eq!(parse_err("{{99999999999999999999}}").kind, syntax("99999999999999999999 overflows int"));
        assert_eq!(parse_err("{{\"abc}}").kind, syntax("unterminated quoted string"));
        assert_eq!(parse_err("{{\"\\q\"}}").kind, syntax("invalid syntax in quoted string"));
    }

    #[test]
    fn pipelines_and_parentheses() {
        let d = data();
        assert_eq!(
            render(
                "{{(index .nested 0).k}} {{len (print \"abc\" \"d\")}} {{.s | len}} {{.s | printf \"%s!\" | len}}",
                d.clone()
            ),
            "v 4 5 6"
        );
        assert_eq!(
            render("{{.xs | len | eq 3}} {{$x := .m}}{{$x.b}} {{.m.b | print}} {{ (print .i) }}", d.clone()),
            "true 2 2 42"
        );
        assert_eq!(render("{{.s |}}", d.clone()), "hello");
        assert_eq!(parse_err("{{.a | 1}}").kind, syntax("non executable command in pipeline stage 2"));
        assert_eq!(parse_err("{{}}").kind, syntax("missing value for command"));
        assert_eq!(parse_err("{{(1}}").kind, syntax("unclosed left paren"));
        assert_eq!(parse_err("{{1)}}").kind, syntax("unexpected right paren"));
        assert_eq!(
            exec_err("{{.s 1}}", d.clone()).kind,
            ErrorKind::Type("s is not a method but has arguments".into())
        );
        assert_eq!(
            exec_err("{{1 | .s}}", d).kind,
            ErrorKind::Type("s is not a method but has arguments".into())
        );
    }

    #[test]
    fn registered_and_istio_functions() {
        let mut f = funcs();
        f.register("upper", Arity::Exactly(1), |a| Ok(Value::String(format::eval_args(a).to_uppercase())));
        f.register("fail", Arity::AtLeast(0), |_| Err("boom".into()));
        let t = Template::parse_with("t", "{{upper .s}} {{.s | upper}}", f.clone()).unwrap();
        assert_eq!(t.render(&data()).unwrap(), "HELLO HELLO");
        let e = Template::parse_with("t", "{{fail}}", f).unwrap().render(&json!({})).unwrap_err();
        assert_eq!(e.kind, call_err("fail", "boom"));
        let v = json!({"v": {"b": [1, 2.5, null, 1e21, 1e-7, 100.0], "a": "<&>\u{2028}\n\u{8}"}});
        assert_eq!(
            render("{{toJson .v}}", v),
            r#"{"a":"\u003c\u0026\u003e\u2028\n\b","b":[1,2.5,null,1e+21,1e-7,100]}"#
        );
        assert_eq!(
            render("{{toJson .missing}} {{toJSON .missing}} {{toJSON .}}", json!({"k": 1})),
            r#"null {} {"k":1}"#
        );
        assert_eq!(
            exec_err("{{toJson 1 2}}", json!({})).kind,
            ErrorKind::ArgCount { func: "toJson".into(), want: Arity::Exactly(1), got: 2 }
        );
        assert_eq!(
            exec_err("{{not}}", json!({})).to_string(),
            "template: t:1:3: executing \"t\": wrong number of args for not: want 1 got 0"
        );
        let plain = Template::parse("t", "{{toJson .}}").unwrap_err();
        assert_eq!(plain.kind, ErrorKind::UnknownFunction("toJson".into()));
    }

    #[test]
    fn parse_errors_name_line_and_column() {
        let e = parse_err("a\n{{if .x}}\nb");
        assert_eq!((e.line, e.col, e.phase, e.kind.clone()), (2, 1, Phase::Parse, ErrorKind::Unclosed("if")));
        assert_eq!(e.to_string(), "template: t:2:1: unexpected EOF: {{if}} has no matching {{end}}");
        let e = parse_err("x\n\n  {{foo 1}}");
        assert_eq!((e.line, e.col, e.kind.clone()), (3, 5, ErrorKind::UnknownFunction("foo".into())));
        assert_eq!(e.to_string(), "template: t:3:5: function \"foo\" not defined");
        assert_eq!(parse_err("{{end}}").kind, ErrorKind::Unexpected("{{end}}".into()));
        assert_eq!(parse_err("{{else}}").kind, ErrorKind::Unexpected("{{else}}".into()));
        let e = parse_err("ok\n{{.a");
        assert_eq!((e.line, e.kind), (2, ErrorKind::UnclosedAction));
        assert_eq!(parse_err("{{range .}}").kind, ErrorKind::Unclosed("range"));
        assert_eq!(parse_err("{{define \"x\"}}{{end}}").kind, ErrorKind::Unsupported("define".into()));
        assert_eq!(parse_err("{{template \"x\"}}").kind, ErrorKind::Unsupported("template".into()));
        assert_eq!(parse_err("{{$x}}").kind, ErrorKind::UndefinedVariable("$x".into()));
        assert_eq!(parse_err("{{.a-b}}").kind, syntax("bad character '-'"));
        assert_eq!(parse_err("{{.a .b\"x\"}}").kind, syntax("bad character '\"'"));
        assert_eq!(
            parse_err("{{print \"a\"\"b\"}}").kind,
            ErrorKind::Unexpected("<\"b\"> in operand".into())
        );
        assert_eq!(parse_err("{{print if}}").kind, ErrorKind::Unexpected("<if> in operand".into()));
        assert_eq!(parse_err("{{#}}").kind, syntax("unrecognized character in action: '#'"));
        let deep = format!("{}1{}", "(".repeat(150), ")".repeat(150));
        assert_eq!(parse_err(&format!("{{{{{deep}}}}}")).kind, syntax("nesting deeper than 100 levels"));
    }

    #[test]
    fn exec_errors_name_line() {
        let e = exec_err("line1\n  {{index .xs 5}}", data());
        assert_eq!((e.line, e.col, e.phase), (2, 5, Phase::Exec));
        assert_eq!(
            e.to_string(),
            "template: t:2:5: executing \"t\": error calling index: index out of range: 5"
        );
        assert_eq!(
            exec_err("{{len 1 2}}", json!({})).kind,
            ErrorKind::ArgCount { func: "len".into(), want: Arity::Exactly(1), got: 2 }
        );
        assert_eq!(
            exec_err("{{.i | not 1}}", data()).kind,
            ErrorKind::ArgCount { func: "not".into(), want: Arity::Exactly(1), got: 2 }
        );
    }
}
