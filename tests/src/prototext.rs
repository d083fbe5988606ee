//! Protobuf text format, enough to read Istio's `.proxycfg` test files as the
//! protobuf JSON of a ProxyConfig: `field: value`, `field { ... }` / `field: {...}`,
//! lists in `[...]`, `#` comments; names become lowerCamelCase, a `{seconds, nanos}`
//! message becomes a duration string, a `{value}` message (a wrapper) its value, and a
//! list of `{key, value}` entries (a map field) an object.

use serde_json::{Map, Value};

/// The text as protobuf JSON.
pub fn to_json(text: &str) -> Result<Value, String> {
    let tokens = tokenize(text)?;
    let mut p = Parser { tokens, at: 0 };
    let fields = p.fields(None)?;
    Ok(Value::Object(fields))
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    Str(String),
    Num(String),
    Punct(char),
}

fn tokenize(text: &str) -> Result<Vec<Tok>, String> {
    let mut out = Vec::new();
    let mut chars = text.chars().peekable();
    while let Some(&c) = chars.peek() {
        match c {
            '#' => while chars.next().is_some_and(|c| c != '\n') {},
            c if c.is_whitespace() => drop(chars.next()),
            '{' | '}' | '[' | ']' | ':' | ',' | ';' => {
                chars.next();
                out.push(Tok::Punct(c));
            }
            '"' | '\'' => {
                chars.next();
                let mut s = String::new();
                loop {
                    match chars.next().ok_or("unterminated string")? {
                        '\\' => s.push(match chars.next().ok_or("unterminated escape")? {
                            'n' => '\n',
                            't' => '\t',
                            other => other,
                        }),
                        q if q == c => break,
                        other => s.push(other),
                    }
                }
                out.push(Tok::Str(s));
            }
            c if c.is_ascii_digit() || c == '-' || c == '.' => {
                let mut s = String::new();
                while let Some(&d) =
                    chars.peek().filter(|d| d.is_ascii_alphanumeric() || matches!(d, '.' | '-' | '+'))
                {
                    s.push(d);
                    chars.next();
                }
                out.push(Tok::Num(s));
            }
            c if c.is_ascii_alphabetic() || c == '_' => {
                let mut s = String::new();
                while let Some(&d) = chars.peek().filter(|d| d.is_ascii_alphanumeric() || **d == '_') {
                    s.push(d);
                    chars.next();
                }
                out.push(Tok::Ident(s));
            }
            other => return Err(format!("unexpected {other:?}")),
        }
    }
    Ok(out)
}

struct Parser {
    tokens: Vec<Tok>,
    at: usize,
}

impl Parser {
    fn next(&mut self) -> Option<Tok> {
        let t = self.tokens.get(self.at).cloned();
        self.at += 1;
        t
    }
    fn peek(&self) -> Option<&Tok> {
        self.tokens.get(self.at)
    }

    /// Fields until `close` (or the end).
    fn fields(&mut self, close: Option<char>) -> Result<Map<String, Value>, String> {
        let mut out = Map::new();
        loop {
            match self.next() {
                None if close.is_none() => return Ok(out),
                None => return Err("unclosed message".into()),
                Some(Tok::Punct(c)) if Some(c) == close => return Ok(out),
                Some(Tok::Punct(',' | ';')) => continue,
                Some(Tok::Ident(name)) => {
                    if self.peek() == Some(&Tok::Punct(':')) {
                        self.next();
                    }
                    let value = self.value()?;
                    out.insert(camel(&name), value);
                }
                Some(other) => return Err(format!("expected a field name, found {other:?}")),
            }
        }
    }

    fn value(&mut self) -> Result<Value, String> {
        match self.next().ok_or("missing value")? {
            Tok::Punct('{') => Ok(shape(self.fields(Some('}'))?)),
            Tok::Punct('[') => {
                let mut items = Vec::new();
                loop {
                    match self.peek() {
                        Some(Tok::Punct(']')) => {
                            self.next();
                            break;
                        }
                        Some(Tok::Punct(',')) => drop(self.next()),
                        _ => items.push(self.value()?),
                    }
                }
                let entries = items
                    .iter()
                    .all(|i| i.get("key").is_some() && i.as_object().is_some_and(|o| o.len() <= 2));
                if entries && !items.is_empty() {
                    return Ok(Value::Object(
                        items
                            .into_iter()
                            .map(|i| (i["key"].as_str().unwrap_or_default().to_string(), i["value"].clone()))
                            .collect(),
                    ));
                }
                Ok(Value::Array(items))
            }
            Tok::Str(s) => Ok(Value::String(s)),
            Tok::Num(n) => serde_json::from_str(&n).map_err(|e| format!("number {n}: {e}")),
            Tok::Ident(i) => Ok(match i.as_str() {
                "true" => Value::Bool(true),
                "false" => Value::Bool(false),
                _ => Value::String(i),
            }),
            Tok::Punct(c) => Err(format!("unexpected {c:?}")),
        }
    }
}

/// Durations and wrappers as protobuf JSON writes them.
fn shape(m: Map<String, Value>) -> Value {
    if !m.is_empty() && m.keys().all(|k| k == "seconds" || k == "nanos") {
        let secs = m.get("seconds").and_then(Value::as_i64).unwrap_or(0);
        let nanos = m.get("nanos").and_then(Value::as_i64).unwrap_or(0);
        let d = std::time::Duration::new(secs as u64, nanos as u32);
        return Value::String(weir_agent::sidecar::config::proxy_json::protobuf_duration(d));
    }
    if m.len() == 1
        && let Some(v) = m.get("value")
        && !v.is_string()
    {
        return v.clone();
    }
    Value::Object(m)
}

fn camel(name: &str) -> String {
    let mut out = String::new();
    let mut upper = false;
    for c in name.chars() {
        match c {
            '_' => upper = true,
            c if upper => {
                out.push(c.to_ascii_uppercase());
                upper = false;
            }
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn istios_proxycfg_shapes() {
        let text = r#"
# a comment
config_path: "/etc/istio/proxy"
drain_duration: {seconds: 2}
control_plane_auth_policy: NONE
extra_stat_tags: ["dlp_success"]
connection_settings: { global_downstream_connection_limit: { value: 25000 } }
runtime_values: [{ key: "a.b" value: "true" }]
tracing: { zipkin: { address: "localhost:6000" }, tls_settings: { mode: SIMPLE, sni: "x"}}
"#;
        let v = to_json(text).unwrap();
        assert_eq!(v["configPath"], "/etc/istio/proxy");
        assert_eq!(v["drainDuration"], "2s");
        assert_eq!(v["controlPlaneAuthPolicy"], "NONE");
        assert_eq!(v["extraStatTags"], serde_json::json!(["dlp_success"]));
        assert_eq!(v["connectionSettings"]["globalDownstreamConnectionLimit"], 25000);
        assert_eq!(v["runtimeValues"]["a.b"], "true");
        assert_eq!(v["tracing"]["tlsSettings"]["mode"], "SIMPLE");
        assert!(to_json("a: {").is_err());
    }
}
