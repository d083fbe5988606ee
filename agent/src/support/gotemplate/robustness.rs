//! Random and mutated templates: any result is fine, a panic is not.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;

use super::{Functions, Template};
use serde_json::{Value, json};

fn read(file: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/testdata/istio-bootstrap").join(file);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// xorshift64*: deterministic, so a failure names a reproducible input.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

const PIECES: &[&str] = &[
    "{{",
    "}}",
    "{{- ",
    " -}}",
    "{{/*",
    "*/}}",
    "*/",
    " ",
    "\n",
    "\t",
    "if ",
    "else ",
    "else if ",
    "end",
    "range ",
    "with ",
    "break",
    "continue",
    "define ",
    ".",
    ".a",
    ".b.c",
    ".arr",
    ".m",
    ".n",
    "$",
    "$x",
    "$x := ",
    "$i, $v := ",
    "$x = ",
    "$.a",
    "|",
    "(",
    ")",
    "\"s\\n\"",
    "\"\\x",
    "`raw`",
    "'c'",
    "'\\u00e9'",
    "1",
    "-2",
    "3.5",
    "0x3",
    "1e3",
    "99999999999999999999",
    "1i",
    "nil",
    "true",
    "and ",
    "or ",
    "not ",
    "eq ",
    "ne ",
    "lt ",
    "le ",
    "len ",
    "index ",
    "print ",
    "printf ",
    "println ",
    "\"%d %s %v %q %x %5.2f %e %c %!\" ",
    "\"%999999999d\" ",
    "js ",
    "html ",
    "urlquery ",
    "toJson ",
    "toJSON ",
    "text",
    "é",
    "\u{2028}",
    "\u{0}",
    ",",
    ":",
    "=",
    "-",
    "\\",
    "\"",
    "`",
    "'",
    "}",
    "{",
    "..",
    "#",
];

fn data() -> Value {
    json!({
        "a": "x<&>'\"", "b": {"c": [1, 2.5, null]}, "arr": [0, "s", {"k": []}], "m": {"z": 1, "a": null},
        "n": null, "e": [],
    })
}

fn exercise(text: &str, data: &Value) {
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        if let Ok(t) = Template::parse_with("fuzz", text, Functions::default().with_istio()) {
            let _ = t.render(data);
        }
    }));
    assert!(outcome.is_ok(), "panicked on template {text:?}");
}

#[test]
fn random_templates_never_panic() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let data = data();
    for _ in 0..20_000 {
        let n = 1 + rng.below(30);
        let text: String = (0..n).map(|_| PIECES[rng.below(PIECES.len())]).collect();
        exercise(&text, &data);
    }
}

const ATOMS: &[&str] = &[
    ".", ".a", ".b.c", ".arr", ".m", ".m.z", ".n", ".e", ".missing", "$", "$.arr", "$x", "1", "-1", "0",
    "2.5", "1e21", "\"str\"", "`<&>`", "'x'", "true", "false", "nil", "3",
];
const FUNCS: &[&str] = &[
    "and",
    "or",
    "not",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "len",
    "index",
    "print",
    "println",
    "js",
    "html",
    "urlquery",
    "toJson",
    "toJSON",
    "printf \"%v %d %s %q %x %X %o %b %c %e %f %g %t %5.1f %-4s %+d %08.3e\"",
];

fn expr(rng: &mut Rng, depth: usize) -> String {
    match rng.below(if depth > 2 { 1 } else { 4 }) {
        0 => ATOMS[rng.below(ATOMS.len())].to_owned(),
        1 => {
            let args: Vec<String> = (0..rng.below(4)).map(|_| expr(rng, depth + 1)).collect();
            format!("{} {}", FUNCS[rng.below(FUNCS.len())], args.join(" "))
        }
        2 => format!("{} | {}", expr(rng, depth + 1), FUNCS[rng.below(FUNCS.len())]),
        _ => format!("({})", expr(rng, depth + 1)),
    }
}

/// A template that mostly parses: balanced control structures around random pipelines.
fn generate(rng: &mut Rng, depth: usize) -> String {
    let mut out = String::new();
    for _ in 0..1 + rng.below(4) {
        let (open, close) = [("{{", "}}"), ("{{- ", " -}}")][rng.below(2)];
        let body = |rng: &mut Rng| {
            if depth < 3 { generate(rng, depth + 1) } else { "x".to_owned() }
        };
        match rng.below(8) {
            0 => out.push_str(" text\n "),
            1 | 2 => out.push_str(&format!("{open}{}{close}", expr(rng, 0))),
            3 => out.push_str(&format!("{open}$x := {}{close}", expr(rng, 0))),
            4 => {
                let (a, b) = (body(rng), body(rng));
                out.push_str(&format!(
                    "{open}if {}{close}{a}{open}else if {}{close}{b}{open}end{close}",
                    expr(rng, 0),
                    expr(rng, 0)
                ));
            }
            5 => {
                let (a, b) = (body(rng), body(rng));
                out.push_str(&format!(
                    "{open}range $i, $v := {}{close}{a}{{{{break}}}}{open}else{close}{b}{open}end{close}",
                    expr(rng, 0)
                ));
            }
            6 => {
                let a = body(rng);
                out.push_str(&format!("{open}with {}{close}{a}{{{{$x = .}}}}{open}end{close}", expr(rng, 0)));
            }
            _ => out.push_str("{{/* note */}}"),
        }
    }
    out
}

#[test]
fn generated_templates_never_panic() {
    let mut rng = Rng(7);
    let data = data();
    let (mut parsed, mut rendered) = (0, 0);
    for _ in 0..5_000 {
        let text = format!("{{{{$x := 0}}}}{}", generate(&mut rng, 0));
        exercise(&text, &data);
        if let Ok(t) = Template::parse_with("fuzz", &text, Functions::default().with_istio()) {
            parsed += 1;
            rendered += usize::from(t.render(&data).is_ok());
        }
    }
    // The generator must reach execution, not just the parser.
    assert!(parsed > 4_000 && rendered > 1_000, "parsed {parsed}, rendered {rendered}");
}

#[test]
fn mutated_bootstrap_never_panics() {
    let original = read("envoy_bootstrap.json");
    let chars: Vec<char> = original.chars().collect();
    let data = json!({"region": "r", "zone": "z", "zipkin": "{}", "extraStatTags": ["a"], "config": {"ProxyAdminPort": 1}});
    let mut rng = Rng(42);
    for _ in 0..300 {
        let mut text = chars.clone();
        for _ in 0..1 + rng.below(4) {
            let at = rng.below(text.len() + 1);
            match rng.below(3) {
                0 => {
                    let end = (at + 1 + rng.below(12)).min(text.len());
                    text.drain(at..end);
                }
                1 => text.splice(at..at, PIECES[rng.below(PIECES.len())].chars()).for_each(drop),
                _ => {
                    let end = (at + rng.below(40)).min(text.len());
                    let copy: Vec<char> = text[at..end].to_vec();
                    let to = rng.below(text.len() + 1);
                    text.splice(to..to, copy).for_each(drop);
                }
            }
        }
        exercise(&text.into_iter().collect::<String>(), &data);
    }
}
