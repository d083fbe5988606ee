//! Unit tests of the whole engine: parse and render small templates, check output and errors.

use serde_json::{Value, json};

use super::error::{call_err, syntax};
use super::format;
use super::{Arity, ErrorKind, Functions, Phase, Template, TemplateError};

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
    assert_eq!(parse_err("{{range $a, 1 := .}}{{end}}").kind, syntax("range can only initialize variables"));
}

#[test]
fn scopes_across_else_and_break_through_with() {
    let t = "{{with $x := .a}}{{$x}}{{else}}[{{$x}}]{{end}}|{{range $i, $e := .e}}{{else}}{{len $i}}{{end}}";
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
        render("{{eq 1 2 3 1}} {{eq \"a\" \"b\"}} {{ne 1 2}} {{eq .x nil}} {{eq .s nil}}", json!({"s": "x"})),
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
    assert_eq!(exec_err("{{lt true false}}", json!({})).kind, call_err("lt", "invalid type for comparison"));
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
    assert_eq!(exec_err("{{index .i 0}}", d.clone()).kind, call_err("index", "can't index item of type int"));
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
    assert_eq!(exec_err("{{1 | .s}}", d).kind, ErrorKind::Type("s is not a method but has arguments".into()));
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
    assert_eq!(parse_err("{{print \"a\"\"b\"}}").kind, ErrorKind::Unexpected("<\"b\"> in operand".into()));
    assert_eq!(parse_err("{{print if}}").kind, ErrorKind::Unexpected("<if> in operand".into()));
    assert_eq!(parse_err("{{#}}").kind, syntax("unrecognized character in action: '#'"));
    let deep = format!("{}1{}", "(".repeat(150), ")".repeat(150));
    assert_eq!(parse_err(&format!("{{{{{deep}}}}}")).kind, syntax("nesting deeper than 100 levels"));
}

#[test]
fn exec_errors_name_line() {
    let e = exec_err("line1\n  {{index .xs 5}}", data());
    assert_eq!((e.line, e.col, e.phase), (2, 5, Phase::Exec));
    assert_eq!(e.to_string(), "template: t:2:5: executing \"t\": error calling index: index out of range: 5");
    assert_eq!(
        exec_err("{{len 1 2}}", json!({})).kind,
        ErrorKind::ArgCount { func: "len".into(), want: Arity::Exactly(1), got: 2 }
    );
    assert_eq!(
        exec_err("{{.i | not 1}}", data()).kind,
        ErrorKind::ArgCount { func: "not".into(), want: Arity::Exactly(1), got: 2 }
    );
}
