//! The values a template computes with: JSON data or Go's "no value", and Go's truth of
//! a value (what `if`, `with`, `and`, `or` and `not` test).

use serde_json::Value;

/// A value while rendering: JSON data, or Go's "no value" (the invalid `reflect.Value` that a
/// missing key, `nil`, or a pipeline yielding a nil interface gives).
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Val {
    Missing,
    Json(Value),
}

impl Val {
    /// As passed to a function taking `interface{}`: "no value" becomes nil.
    pub(super) fn into_value(self) -> Value {
        match self {
            Val::Missing => Value::Null,
            Val::Json(v) => v,
        }
    }
}

/// Go's truth: false, 0, nil, "no value" and empty strings, arrays and objects are false.
pub(super) fn truth(v: &Val) -> bool {
    match v {
        Val::Missing | Val::Json(Value::Null) => false,
        Val::Json(Value::Bool(b)) => *b,
        Val::Json(Value::Number(n)) => n.as_f64().is_some_and(|f| f != 0.0),
        Val::Json(Value::String(s)) => !s.is_empty(),
        Val::Json(Value::Array(a)) => !a.is_empty(),
        Val::Json(Value::Object(m)) => !m.is_empty(),
    }
}
