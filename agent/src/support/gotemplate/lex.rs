//! The lexer: source text to tokens, with trim markers applied to the text around actions and
//! literals decoded and typed as Go's lexer and parser read them.

use serde_json::Value;

use super::error::{ErrorKind, Fail, syntax};

#[derive(Debug, Clone, PartialEq)]
pub(super) enum Tok {
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
pub(super) struct Token {
    pub(super) tok: Tok,
    pub(super) pos: usize,
    /// White space comes before it inside the action: separates operands.
    pub(super) spaced: bool,
}

pub(super) static EOF: Token = Token { tok: Tok::Eof, pos: 0, spaced: false };

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

/// The tokens of `src`, ending with `Eof`, or with the lexing error where lexing stopped.
pub(super) fn lex(src: &str) -> Vec<Token> {
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
