//! Go's text forms of JSON values: `fmt`'s `%v`, `Sprint`, `Sprintln` and a `Sprintf` subset,
//! the `js`/`html`/`urlquery` escapers of `text/template`, and `encoding/json`'s `Marshal`.
//! Each value prints as the Go value `encoding/json` would decode it into (`interface{}`).

use std::fmt::Write as _;

use serde_json::{Map, Number, Value};

/// Go's name for the dynamic type of a decoded JSON value, as `fmt` and the template errors show it.
pub(super) fn go_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "<nil>",
        Value::Bool(_) => "bool",
        Value::Number(n) if n.is_i64() => "int",
        Value::Number(n) if n.is_u64() => "uint64",
        Value::Number(_) => "float64",
        Value::String(_) => "string",
        Value::Array(_) => "[]interface {}",
        Value::Object(_) => "map[string]interface {}",
    }
}

/// An object's entries in Go's map order (sorted keys), whatever order serde_json keeps.
fn sorted(m: &Map<String, Value>) -> Vec<(&String, &Value)> {
    let mut entries: Vec<_> = m.iter().collect();
    entries.sort_by(|a, b| a.0.cmp(b.0));
    entries
}

/// `fmt`'s `%v`: strings raw, `<nil>`, `[a b]`, `map[k:v]`, floats in `%g` form.
pub(super) fn write_v(out: &mut String, v: &Value) {
    format_arg(out, 'v', &Spec::default(), v);
}

/// `fmt.Sprint`: a space between operands when neither side is a string.
pub(super) fn sprint(args: &[Value]) -> String {
    let mut out = String::new();
    let mut prev_string = true;
    for a in args {
        if !prev_string && !a.is_string() {
            out.push(' ');
        }
        write_v(&mut out, a);
        prev_string = a.is_string();
    }
    out
}

/// `fmt.Sprintln`: operands always space-separated, then a newline.
pub(super) fn sprintln(args: &[Value]) -> String {
    let mut out = String::new();
    for (i, a) in args.iter().enumerate() {
        if i > 0 {
            out.push(' ');
        }
        write_v(&mut out, a);
    }
    out.push('\n');
    out
}

/// The text the escaper builtins work on (Go's `evalArgs`): one string as is, else `Sprint`
/// with nil shown as `<no value>`.
pub(super) fn eval_args(args: &[Value]) -> String {
    if let [Value::String(s)] = args {
        return s.clone();
    }
    let shown: Vec<Value> = args
        .iter()
        .map(|a| if a.is_null() { Value::String("<no value>".into()) } else { a.clone() })
        .collect();
    sprint(&shown)
}

/// One `%` directive's flags, width and precision.
#[derive(Debug, Default, Clone, Copy)]
struct Spec {
    minus: bool,
    plus: bool,
    sharp: bool,
    zero: bool,
    space: bool,
    width: usize,
    prec: Option<usize>,
}

/// Go's `fmt` refuses widths and precisions from a million up.
const MAX_WIDTH: usize = 1_000_000;

/// `fmt.Sprintf` for the verbs templates use: `v s d t q x X o b c e E f F g G %`, flags
/// `-+# 0`, width and precision; Go's `%!verb(type=value)`, `(MISSING)` and `(EXTRA ...)` notes.
pub(super) fn sprintf(format: &str, args: &[Value]) -> String {
    let mut out = String::new();
    let mut used = 0;
    let mut rest = format;
    while let Some(i) = rest.find('%') {
        out.push_str(&rest[..i]);
        let (spec, verb, len) = directive(&mut out, &rest[i + 1..]);
        rest = &rest[i + 1 + len..];
        match (verb, args.get(used)) {
            (None, _) => out.push_str("%!(NOVERB)"),
            (Some('%'), _) => out.push('%'),
            (Some(verb), None) => {
                let _ = write!(out, "%!{verb}(MISSING)");
            }
            (Some(verb), Some(arg)) => {
                used += 1;
                format_arg(&mut out, verb, &spec, arg);
            }
        }
    }
    out.push_str(rest);
    if let Some(extra) = args.get(used..).filter(|e| !e.is_empty()) {
        out.push_str("%!(EXTRA ");
        for (i, a) in extra.iter().enumerate() {
            if i > 0 {
                out.push_str(", ");
            }
            if !a.is_null() {
                let _ = write!(out, "{}=", go_type(a));
            }
            write_v(&mut out, a);
        }
        out.push(')');
    }
    out
}

/// Parses the directive after a `%`: its spec, its verb, and how many bytes it took.
fn directive(out: &mut String, s: &str) -> (Spec, Option<char>, usize) {
    let mut spec = Spec::default();
    let mut it = s.char_indices().peekable();
    while let Some(&(_, c)) = it.peek() {
        match c {
            '-' => spec.minus = true,
            '+' => spec.plus = true,
            '#' => spec.sharp = true,
            '0' => spec.zero = true,
            ' ' => spec.space = true,
            _ => break,
        }
        it.next();
    }
    let number = |it: &mut std::iter::Peekable<std::str::CharIndices>| {
        let mut n: Option<usize> = None;
        while let Some(d) = it.peek().and_then(|&(_, c)| c.to_digit(10)) {
            n = Some(n.unwrap_or(0).saturating_mul(10).saturating_add(d as usize));
            it.next();
        }
        n
    };
    let width = number(&mut it).unwrap_or(0);
    if width >= MAX_WIDTH {
        out.push_str("%!(BADWIDTH)");
    } else {
        spec.width = width;
    }
    if let Some(&(_, '.')) = it.peek() {
        it.next();
        match number(&mut it).unwrap_or(0) {
            p if p >= MAX_WIDTH => out.push_str("%!(BADPREC)"),
            p => spec.prec = Some(p),
        }
    }
    match it.next() {
        Some((i, c)) => (spec, Some(c), i + c.len_utf8()),
        None => (spec, None, s.len()),
    }
}

/// Formats one argument; Go applies the verb to each element of slices and maps.
fn format_arg(out: &mut String, verb: char, spec: &Spec, v: &Value) {
    match v {
        Value::Array(items) => {
            out.push('[');
            for (i, e) in items.iter().enumerate() {
                if i > 0 {
                    out.push(' ');
                }
                format_arg(out, verb, spec, e);
            }
            out.push(']');
        }
        Value::Object(m) => {
            out.push_str("map[");
            for (i, (k, e)) in sorted(m).into_iter().enumerate() {
                if i > 0 {
                    out.push(' ');
                }
                format_arg(out, verb, spec, &Value::String(k.clone()));
                out.push(':');
                format_arg(out, verb, spec, e);
            }
            out.push(']');
        }
        _ => match scalar(verb, spec, v) {
            Some((sign, body)) => pad(out, sign, &body, spec),
            None if v.is_null() => {
                let _ = write!(out, "%!{verb}(<nil>)");
            }
            None => {
                let _ = write!(out, "%!{verb}({}=", go_type(v));
                write_v(out, v);
                out.push(')');
            }
        },
    }
}

/// A scalar's sign and digits/text under `verb`, or None for a verb that doesn't fit its type.
fn scalar(verb: char, spec: &Spec, v: &Value) -> Option<(&'static str, String)> {
    Some(match (verb, v) {
        ('v', Value::Null) => ("", "<nil>".into()),
        ('v' | 't', Value::Bool(b)) => ("", b.to_string()),
        ('v' | 's', Value::String(s)) => {
            ("", spec.prec.map_or_else(|| s.clone(), |p| s.chars().take(p).collect()))
        }
        ('q', Value::String(s)) => ("", quote(s, '"')),
        ('x' | 'X', Value::String(s)) => (
            "",
            s.bytes().map(|b| if verb == 'x' { format!("{b:02x}") } else { format!("{b:02X}") }).collect(),
        ),
        (_, Value::Number(n)) => return number(verb, spec, n),
        _ => return None,
    })
}

fn number(verb: char, spec: &Spec, n: &Number) -> Option<(&'static str, String)> {
    let sign = |negative: bool| match () {
        _ if negative => "-",
        _ if spec.plus => "+",
        _ if spec.space => " ",
        _ => "",
    };
    if let Some(i) = n.as_i64().map(i128::from).or_else(|| n.as_u64().map(i128::from)) {
        let m = i.unsigned_abs();
        let (prefix, digits) = match verb {
            'v' | 'd' => ("", m.to_string()),
            'x' => ("0x", format!("{m:x}")),
            'X' => ("0X", format!("{m:X}")),
            'o' => ("0", format!("{m:o}")),
            'b' => ("", format!("{m:b}")),
            'c' => return Some(("", rune(i).to_string())),
            'q' => return Some(("", quote(&rune(i).to_string(), '\''))),
            _ => return None,
        };
        let digits = format!("{digits:0>width$}", width = spec.prec.unwrap_or(0));
        let prefix = if spec.sharp { prefix } else { "" };
        return Some((sign(i < 0), format!("{prefix}{digits}")));
    }
    let f = n.as_f64()?;
    let body = match verb {
        'v' | 'g' | 'G' => fmt_g(f, spec.prec, verb == 'G'),
        'e' | 'E' => {
            let p = spec.prec.unwrap_or(6);
            let (digits, point) = decimal(f, Some(p + 1));
            e_form(&digits, point, p, verb == 'E')
        }
        'f' | 'F' => format!("{:.*}", spec.prec.unwrap_or(6), f.abs()),
        _ => return None,
    };
    Some((sign(f.is_sign_negative()), body))
}

fn rune(i: i128) -> char {
    u32::try_from(i).ok().and_then(char::from_u32).unwrap_or('\u{FFFD}')
}

fn pad(out: &mut String, sign: &str, body: &str, spec: &Spec) {
    let fill = spec.width.saturating_sub(sign.chars().count() + body.chars().count());
    if spec.minus {
        out.push_str(sign);
        out.push_str(body);
        out.extend(std::iter::repeat_n(' ', fill));
    } else if spec.zero {
        out.push_str(sign);
        out.extend(std::iter::repeat_n('0', fill));
        out.push_str(body);
    } else {
        out.extend(std::iter::repeat_n(' ', fill));
        out.push_str(sign);
        out.push_str(body);
    }
}

/// The decimal digits of |f| (no trailing zeros) and the decimal point's place:
/// |f| = 0.DIGITS × 10^point. `sig` rounds to that many significant digits; None
/// gives the shortest digits that read back as `f`, as Go's precision -1 does.
fn decimal(f: f64, sig: Option<usize>) -> (String, i32) {
    let s = match sig {
        None => format!("{:e}", f.abs()),
        Some(n) => format!("{:.*e}", n.max(1) - 1, f.abs()),
    };
    let (mantissa, exp) = s.split_once('e').unwrap_or((&s, "0"));
    let mut digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    while digits.len() > 1 && digits.ends_with('0') {
        digits.pop();
    }
    if digits.is_empty() {
        digits.push('0');
    }
    (digits, exp.parse::<i32>().unwrap_or(0) + 1)
}

/// `d.ddde±XX` with `frac` digits after the point, as strconv writes it.
fn e_form(digits: &str, point: i32, frac: usize, upper: bool) -> String {
    let mut ds = digits.chars();
    let mut s = String::new();
    s.push(ds.next().unwrap_or('0'));
    if frac > 0 {
        s.push('.');
        s.extend(ds.chain(std::iter::repeat('0')).take(frac));
    }
    let exp = if digits == "0" { 0 } else { point - 1 };
    let (e, sign) = (if upper { 'E' } else { 'e' }, if exp < 0 { '-' } else { '+' });
    let _ = write!(s, "{e}{sign}{:02}", exp.unsigned_abs());
    s
}

/// `ddd.ddd` with `frac` digits after the point.
fn f_form(digits: &str, point: i32, frac: usize) -> String {
    let d = digits.as_bytes();
    let at = |i: i64| usize::try_from(i).ok().and_then(|i| d.get(i)).map_or('0', |&b| char::from(b));
    let mut s: String = if point <= 0 { "0".into() } else { (0..i64::from(point)).map(at).collect() };
    if frac > 0 {
        s.push('.');
        s.extend((0..frac as i64).map(|i| at(i64::from(point) + i)));
    }
    s
}

/// strconv's `%g`: `%e` form when the exponent is below -4 or at least the precision
/// (6 for the shortest form, as `%v` uses), else `%f` form; no trailing zeros.
fn fmt_g(f: f64, prec: Option<usize>, upper: bool) -> String {
    let (digits, point) = decimal(f, prec);
    let eprec = prec.map_or(6, |p| p.max(1) as i64);
    let exp = i64::from(point) - 1;
    if exp < -4 || exp >= eprec {
        e_form(&digits, point, digits.len() - 1, upper)
    } else {
        f_form(&digits, point, (digits.len() as i64 - i64::from(point)).max(0) as usize)
    }
}

/// Go's `unicode.IsPrint`: letters, marks, numbers, punctuation, symbols and U+0020. Other
/// spaces, controls, format characters, private use and noncharacters are not; unassigned
/// code points (which Rust's std can't tell apart) count as printable.
fn is_print(c: char) -> bool {
    if c == ' ' {
        return true;
    }
    let u = c as u32;
    !(c.is_control()
        || c.is_whitespace()
        || matches!(u, 0xAD | 0x600..=0x605 | 0x61C | 0x6DD | 0x70F | 0x890..=0x891 | 0x8E2 | 0x180E
            | 0x200B..=0x200F | 0x202A..=0x202E | 0x2060..=0x2064 | 0x2066..=0x206F | 0xFEFF
            | 0xFFF9..=0xFFFB | 0x110BD | 0x110CD | 0x13430..=0x1343F | 0x1BCA0..=0x1BCA3
            | 0x1D173..=0x1D17A | 0xE0001 | 0xE0020..=0xE007F | 0xE000..=0xF8FF | 0xF0000..
            | 0xFDD0..=0xFDEF)
        || u & 0xFFFE == 0xFFFE)
}

/// strconv's `Quote`/`QuoteRune` with delimiter `q`.
fn quote(s: &str, q: char) -> String {
    let mut out = String::from(q);
    for c in s.chars() {
        match c {
            c if c == q || c == '\\' => {
                out.push('\\');
                out.push(c);
            }
            c if is_print(c) => out.push(c),
            '\x07' => out.push_str("\\a"),
            '\x08' => out.push_str("\\b"),
            '\x0c' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\x0b' => out.push_str("\\v"),
            c if c < ' ' || c == '\x7f' => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c if (c as u32) < 0x10000 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => {
                let _ = write!(out, "\\U{:08x}", c as u32);
            }
        }
    }
    out.push(q);
    out
}

/// `template.JSEscapeString`: `\ ' "` backslashed; `< > & =` and controls as `\u00XX`;
/// non-ASCII kept when printable, else `\uXXXX`.
pub(super) fn js_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\\' | '\'' | '"' => {
                out.push('\\');
                out.push(c);
            }
            '<' | '>' | '&' | '=' => {
                let _ = write!(out, "\\u{:04X}", c as u32);
            }
            c if c < ' ' || (!c.is_ascii() && !is_print(c)) => {
                let _ = write!(out, "\\u{:04X}", c as u32);
            }
            c => out.push(c),
        }
    }
    out
}

/// `template.HTMLEscapeString`.
pub(super) fn html_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '"' => out.push_str("&#34;"),
            '\'' => out.push_str("&#39;"),
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '\0' => out.push('\u{FFFD}'),
            c => out.push(c),
        }
    }
    out
}

/// `url.QueryEscape`: unreserved bytes kept, space as `+`, the rest `%XX`.
pub(super) fn url_query_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => out.push(char::from(b)),
            b' ' => out.push('+'),
            b => {
                let _ = write!(out, "%{b:02X}");
            }
        }
    }
    out
}

/// Go's `json.Marshal` of the value: sorted keys, HTML-safe string escapes, Go's float form.
pub fn to_json(value: &Value) -> String {
    let mut out = String::new();
    write_json(&mut out, value);
    out
}

fn write_json(out: &mut String, v: &Value) {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) if n.is_f64() => out.push_str(&json_float(n.as_f64().unwrap_or(0.0))),
        Value::Number(n) => out.push_str(&n.to_string()),
        Value::String(s) => json_quote(out, s),
        Value::Array(items) => {
            out.push('[');
            for (i, e) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_json(out, e);
            }
            out.push(']');
        }
        Value::Object(m) => {
            out.push('{');
            for (i, (k, e)) in sorted(m).into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                json_quote(out, k);
                out.push(':');
                write_json(out, e);
            }
            out.push('}');
        }
    }
}

/// encoding/json's float: plain digits, exponent form below 1e-6 or from 1e21 (`1e-7`, `1e+21`).
fn json_float(f: f64) -> String {
    let (digits, point) = decimal(f, None);
    let abs = f.abs();
    let mut s = if abs != 0.0 && !(1e-6..1e21).contains(&abs) {
        let mut e = e_form(&digits, point, digits.len() - 1, false);
        if let Some(i) = e.find("e-0") {
            e.remove(i + 2);
        }
        e
    } else {
        f_form(&digits, point, (digits.len() as i64 - i64::from(point)).max(0) as usize)
    };
    if f.is_sign_negative() {
        s.insert(0, '-');
    }
    s
}

fn json_quote(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\x08' => out.push_str("\\b"),
            '\x0c' => out.push_str("\\f"),
            '<' | '>' | '&' | '\u{2028}' | '\u{2029}' => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if c < ' ' => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}
