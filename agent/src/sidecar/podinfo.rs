//! The downward-API files kubelet writes into `./etc/istio/pod` (`labels`,
//! `annotations`): one `key="value"` line each, the value Go-quoted. Read as
//! pilot-agent's `ParseDownwardAPI` reads them: a line without `=` is skipped, the key
//! is taken verbatim, and a value that is not a valid Go quoted string makes the whole
//! file invalid (it is then ignored, with a warning naming it).

use std::collections::BTreeMap;

/// Why a downward-API file was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {value:?} is not a Go-quoted string")]
pub struct PodInfoError {
    pub line: usize,
    pub value: String,
}

/// Parses a downward-API file (all or nothing).
pub fn parse(text: &str) -> Result<BTreeMap<String, String>, PodInfoError> {
    let mut out = BTreeMap::new();
    for (index, line) in text.split('\n').enumerate() {
        let Some((key, quoted)) = line.split_once('=') else { continue };
        let value =
            unquote(quoted).ok_or_else(|| PodInfoError { line: index + 1, value: quoted.to_string() })?;
        out.insert(key.to_string(), value);
    }
    Ok(out)
}

/// Go's `strconv.Unquote`: a double-quoted string with Go escapes, a back-quoted raw
/// string, or a single-quoted character.
pub fn unquote(s: &str) -> Option<String> {
    // Only an ASCII quote opens and closes a literal, so both ends slice on a char
    // boundary (a value like `é`, one char of two bytes, is not quoted).
    let first = s.chars().next()?;
    if !matches!(first, '`' | '"' | '\'') || s.len() < 2 || !s.ends_with(first) {
        return None;
    }
    let inner = &s[1..s.len() - 1];
    match first {
        '`' => (!inner.contains('`')).then(|| inner.replace('\r', "")),
        '"' => unescape(inner, '"'),
        '\'' => unescape(inner, '\'').filter(|c| c.chars().count() == 1),
        _ => None,
    }
}

/// The body of a Go interpreted string literal quoted with `quote`.
fn unescape(s: &str, quote: char) -> Option<String> {
    if s.contains('\n') {
        return None;
    }
    let mut out = String::with_capacity(s.len());
    let mut bytes: Vec<u8> = Vec::new();
    let mut chars = s.chars();
    let flush = |bytes: &mut Vec<u8>, out: &mut String| -> Option<()> {
        if !bytes.is_empty() {
            out.push_str(std::str::from_utf8(bytes).ok()?);
            bytes.clear();
        }
        Some(())
    };
    while let Some(c) = chars.next() {
        if c == quote {
            return None;
        }
        if c != '\\' {
            flush(&mut bytes, &mut out)?;
            out.push(c);
            continue;
        }
        let escaped = chars.next()?;
        let simple = match escaped {
            'a' => Some('\u{7}'),
            'b' => Some('\u{8}'),
            'f' => Some('\u{c}'),
            'n' => Some('\n'),
            'r' => Some('\r'),
            't' => Some('\t'),
            'v' => Some('\u{b}'),
            '\\' => Some('\\'),
            c if c == quote => Some(c),
            _ => None,
        };
        if let Some(c) = simple {
            flush(&mut bytes, &mut out)?;
            out.push(c);
            continue;
        }
        let mut digits = |n: usize, radix: u32| -> Option<u32> {
            let text: String = (0..n).map(|_| chars.next()).collect::<Option<String>>()?;
            u32::from_str_radix(&text, radix).ok().filter(|_| text.chars().all(|c| c.is_digit(radix)))
        };
        match escaped {
            // \xHH and \ooo are bytes; consecutive ones may spell a UTF-8 sequence.
            'x' => bytes.push(u8::try_from(digits(2, 16)?).ok()?),
            '0'..='7' => {
                let rest = digits(2, 8)?;
                let value = escaped.to_digit(8)? * 64 + rest;
                bytes.push(u8::try_from(value).ok()?);
            }
            'u' => {
                flush(&mut bytes, &mut out)?;
                out.push(char::from_u32(digits(4, 16)?)?);
            }
            'U' => {
                flush(&mut bytes, &mut out)?;
                out.push(char::from_u32(digits(8, 16)?)?);
            }
            _ => return None,
        }
    }
    flush(&mut bytes, &mut out)?;
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found while writing the `pod_annotations` fuzz target: a value whose first and last char is the
    /// same multi-byte char (`é`, `éxé`) was sliced inside that char and panicked.
    #[test]
    fn a_value_bounded_by_a_multibyte_char_is_invalid_not_a_panic() {
        for value in ["é", "éxé", "€€"] {
            assert_eq!(unquote(value), None, "{value}");
            let text = format!("a={value}\n");
            assert_eq!(parse(&text), Err(PodInfoError { line: 1, value: value.into() }));
        }
        assert_eq!(unquote("\"é\""), Some("é".into()));
    }

    #[test]
    fn kubelets_file_is_read_as_go_reads_it() {
        let text = "app=\"reviews\"\nistio.io/rev=\"default\"\nsidecar.istio.io/status=\"{\\\"a\\\":[1]}\"\n\nno-equals\n";
        let labels = parse(text).unwrap();
        assert_eq!(labels["app"], "reviews");
        assert_eq!(labels["sidecar.istio.io/status"], "{\"a\":[1]}");
        assert_eq!(labels.len(), 3, "the empty line and a line without = are skipped");
    }

    #[test]
    fn go_escapes_are_understood() {
        assert_eq!(unquote(r#""tab\there \u00e9 \x41 \101 \\ \"""#).unwrap(), "tab\there é A A \\ \"");
        assert_eq!(unquote(r#""\xc3\xa9""#).unwrap(), "é", "hex bytes spell UTF-8");
        assert_eq!(unquote("`raw \\n`").unwrap(), "raw \\n");
        assert_eq!(unquote("'x'").unwrap(), "x");
    }

    #[test]
    fn one_bad_line_invalidates_the_file() {
        assert_eq!(
            parse("a=\"1\"\nb=unquoted\n").unwrap_err(),
            PodInfoError { line: 2, value: "unquoted".into() }
        );
        assert!(parse("a=\"1\"\r\n").is_err(), "a trailing CR is not Go-quoted");
        for bad in [r#""\q""#, r#""open"#, r#""a"b""#, r#""\xZZ""#, "'ab'", r#""\xff""#] {
            assert_eq!(unquote(bad), None, "{bad}");
        }
    }
}
