//! The functions templates may call: the [`Functions`] registry (Go's builtins plus the
//! embedder's, each with its [`Arity`]) and what the builtins other than `and`/`or` do.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use serde_json::Value;

use super::arity::Arity;
use super::error::{ErrorKind, call_err};
use super::format::{self, go_type, to_json};
use super::value::{Val, truth};

/// A function registered by the embedder: arguments in order (a piped value last), Go's
/// "no value" passed as `Null`. An `Err` stops rendering with "error calling NAME: ...".
type CustomFn = Arc<dyn Fn(&[Value]) -> Result<Value, String> + Send + Sync>;

#[derive(Clone)]
pub(super) enum Func {
    Builtin(Builtin),
    Custom(Arity, CustomFn),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Builtin {
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

    pub(super) fn arity(self) -> Arity {
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

    pub(super) fn get(&self, name: &str) -> Option<&Func> {
        self.map.get(name)
    }
}

// ---------------------------------------------------------------------------------------------
// Builtins other than and/or

/// Calls builtin `b` (as `name`) on evaluated arguments, their number already checked; `and` and
/// `or` short-circuit, so the executor runs them itself.
pub(super) fn builtin(b: Builtin, name: &str, args: Vec<Val>) -> Result<Val, ErrorKind> {
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

/// `index x 1 "k"`: `x[1]["k"]`; a missing key gives nil, a string gives a byte.
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
