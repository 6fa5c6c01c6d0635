//! Token usage read from an LLM API's response body as it streams past.
//!
//! A metered response is forwarded to its client unchanged, chunk by chunk,
//! as the chunks arrive. The [`Meter`] only looks at copies of them and never
//! gathers the body: what it holds is the one piece it is reading at the
//! time, and never more than [`MAX_HELD`] bytes of that.
//!
//! - An event stream (`text/event-stream`) is cut into events by the WHATWG
//!   EventSource rules, whatever the chunk boundaries: they may fall inside
//!   a line end, a field name or a UTF-8 character. Only the current event's
//!   data is held; when the event ends it is read and let go. An event larger
//!   than the bound is skipped to its end unread, and the events after it are
//!   read as usual.
//! - A JSON body of any size is walked by a scanner whose state is a handful
//!   of words: the nesting depth, whether it is inside a string or an escape,
//!   and the decoded name of the current top-level member. Only the values of
//!   the few top-level members the reader looks at (`usage`, say) are held,
//!   each parsed with serde_json once it ends. Everything else, typically a
//!   completion's text and most of the body, is skipped with byte searches.
//!   Text inside a string therefore never passes for a member, and a member
//!   nested deeper never passes for a top-level one.
//!
//! An event's data is read with the same scanner, so the text streamed in the
//! events is skipped rather than parsed too.
//!
//! The [`Reader`] decides what is counted: the vendor formats weigh input and
//! output tokens by [`Weights`]; [`Reader::Json`] sums whole numbers found at
//! given paths. The usage is known once the body has ended
//! ([`Meter::finish`]): a stream reports it in its last events, and a later
//! report replaces an earlier one, as a later duplicate member does in JSON.
//!
//! The scanner checks the structure it walks (brackets, strings, the
//! top-level member names and separators) and leaves the values it holds to
//! serde_json; it does not check each number and literal of the values it
//! skips. A JSON body whose structure breaks, or that ends before its
//! top-level object closes, yields no usage at all, even if a usage member
//! was read before the break: a body that is not JSON is not trusted for
//! any part of it.

use memchr::memchr2;
use serde_json::{Map, Value};

/// The API formats whose usage a meter reads (`cost_from_response.format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum FormatName {
    /// OpenAI's chat/completions, completions and Responses API.
    Openai,
    /// Anthropic's messages API.
    Anthropic,
}

/// Where the usage is read.
#[derive(Debug, Clone, PartialEq)]
pub enum Reader {
    /// Whole numbers at these dotted paths of a JSON body (e.g. ["usage", "total_tokens"]), summed.
    /// Only top-level member paths: `usage.total_tokens` means the member `total_tokens` of the
    /// top-level member `usage`, never a match inside other text or deeper elsewhere.
    ///
    /// In an event stream each event's data is read the same way, and the last event in which
    /// any of the paths is found gives the usage.
    Json(Vec<Vec<String>>),
    /// OpenAI's chat/completions and completions (JSON body: top-level `usage`; SSE stream: the
    /// top-level `usage` of the chunk that carries it, `usage: null` in the others; `data: [DONE]`
    /// ignored) and the Responses API (SSE event whose data has `"type":"response.completed"`:
    /// `response.usage`; a JSON body with `"object":"response"` has top-level `usage` with
    /// input_tokens/output_tokens).
    ///
    /// The Responses API's `response.incomplete` and `response.failed` events carry the usage
    /// of what was generated too, and are read like `response.completed`.
    OpenAi(Weights),
    /// Anthropic's messages API: JSON body `usage.input_tokens + usage.output_tokens`; in a stream
    /// `message_start`'s `message.usage.input_tokens` (and its output_tokens) plus the LAST
    /// `message_delta`'s `usage.output_tokens` (message_delta carries a cumulative output count).
    Anthropic(Weights),
}

/// How input and output tokens are weighed where a format reports both.
///
/// A response costs `input * self.input + output * self.output`, in
/// saturating arithmetic. The input tokens are OpenAI's `prompt_tokens`
/// (`input_tokens` in the Responses API) and Anthropic's `input_tokens`; the
/// output tokens are `completion_tokens` (`output_tokens`) and
/// `output_tokens`. With the default weights (1, 1) an OpenAI response costs
/// its `total_tokens`. A usage that reports only `total_tokens` is charged at
/// the larger of the two weights, as it cannot be told apart.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Weights {
    /// What one input (prompt) token costs.
    pub input: u64,
    /// What one output (completion) token costs.
    pub output: u64,
}

impl Default for Weights {
    /// Every token costs 1.
    fn default() -> Self {
        Weights {
            input: 1,
            output: 1,
        }
    }
}

/// The largest event (SSE) or top-level member value (JSON) the meter holds to read it.
pub const MAX_HELD: usize = 64 * 1024;

/// The capacity a held buffer keeps from one event or member to the next; a
/// larger one is given back, so that a meter idles small.
const KEEP_CAPACITY: usize = 8 * 1024;

/// The smallest capacity a held buffer grows to.
const MIN_CAPACITY: usize = 256;

/// The longest event type (`event:`) kept; a longer one is no type this
/// module reads.
const MAX_EVENT_TYPE: usize = 64;

/// The deepest nesting inside a top-level member's value: with the top-level
/// object itself, serde_json's own limit of 128.
const MAX_DEPTH: u32 = 127;

/// A UTF-8 byte order mark, skipped at the start of a body.
const BOM: &[u8] = b"\xEF\xBB\xBF";

/// Reads the token usage of one response from copies of its body's chunks.
#[derive(Debug)]
pub struct Meter {
    /// How many bytes of a byte order mark the body has started with, until
    /// it is known whether it has one.
    bom: Option<usize>,
    body: Body,
    reading: Reading,
}

/// How the body is cut into the pieces that are read.
#[derive(Debug)]
enum Body {
    Events(Events),
    Json(Scanner),
}

impl Meter {
    /// A meter for a response whose Content-Type says `event_stream` (text/event-stream) or not (JSON).
    pub fn new(reader: Reader, event_stream: bool) -> Meter {
        let scanner = Scanner::new(reader.wanted());
        let body = if event_stream {
            Body::Events(Events::new(scanner))
        } else {
            Body::Json(scanner)
        };
        Meter {
            bom: Some(0),
            body,
            reading: Reading::new(reader),
        }
    }

    /// Observes the next chunk of the body, as forwarded.
    pub fn feed(&mut self, chunk: &[u8]) {
        let Some(seen) = self.bom else {
            self.body.feed(chunk, &mut self.reading);
            return;
        };
        let matched = chunk
            .iter()
            .zip(&BOM[seen..])
            .take_while(|(byte, bom)| byte == bom)
            .count();
        if seen + matched == BOM.len() {
            self.bom = None;
            self.body.feed(&chunk[matched..], &mut self.reading);
        } else if matched == chunk.len() {
            // Still possibly a byte order mark, split across chunks.
            self.bom = Some(seen + matched);
        } else {
            // Not one after all: what looked like its start is body.
            self.bom = None;
            self.body.feed(&BOM[..seen], &mut self.reading);
            self.body.feed(chunk, &mut self.reading);
        }
    }

    /// Bytes held right now (the partial event or member value being gathered), at most MAX_HELD;
    /// the caller counts these against a shared buffer budget.
    pub fn held(&self) -> usize {
        match &self.body {
            Body::Events(events) => events.data.len(),
            Body::Json(scanner) => scanner.held.len(),
        }
    }

    /// The usage read once the body has ended (`None`: the body carried no usage the reader
    /// recognises). A stream cut mid-event does not count that partial event (only complete events —
    /// for SSE an event ends at a blank line; at end of body a final event without its blank line IS
    /// dispatched only if `complete` is true, i.e. the body ended normally).
    ///
    /// A JSON body counts only if its top-level object closed, with nothing but
    /// whitespace after it; `complete` does not change that.
    pub fn finish(mut self, complete: bool) -> Option<u64> {
        if let Some(seen) = self.bom.take() {
            self.body.feed(&BOM[..seen], &mut self.reading);
        }
        match &mut self.body {
            Body::Events(events) => {
                if complete {
                    events.end(&mut self.reading);
                }
            }
            Body::Json(scanner) => {
                if scanner.is_done() {
                    self.reading.body(&scanner.members);
                }
            }
        }
        self.reading.result()
    }
}

impl Body {
    fn feed(&mut self, chunk: &[u8], reading: &mut Reading) {
        match self {
            Body::Events(events) => events.feed(chunk, reading),
            Body::Json(scanner) => scanner.feed(chunk),
        }
    }
}

impl Reader {
    /// The top-level members whose values are read.
    fn wanted(&self) -> Vec<String> {
        let owned = |names: &[&str]| names.iter().map(|name| name.to_string()).collect();
        match self {
            Reader::Json(paths) => {
                let mut names: Vec<String> = Vec::new();
                for first in paths.iter().filter_map(|path| path.first()) {
                    if !names.contains(first) {
                        names.push(first.clone());
                    }
                }
                names
            }
            Reader::OpenAi(_) => owned(&["usage", "type", "response"]),
            Reader::Anthropic(_) => owned(&["usage", "type", "message"]),
        }
    }
}

/// What has been read so far, and how it is turned into a cost.
#[derive(Debug)]
struct Reading {
    reader: Reader,
    /// [`Reader::Json`]: the sum of the paths where last found.
    sum: Option<u64>,
    /// The vendor formats: the tokens as last reported.
    tokens: Tokens,
}

/// Token counts as a usage object reports them; `None` where it does not.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
struct Tokens {
    input: Option<u64>,
    output: Option<u64>,
    total: Option<u64>,
}

impl Tokens {
    /// The whole numbers of a usage object, under either vendor's names:
    /// `prompt_tokens`/`completion_tokens` (OpenAI chat and completions) or
    /// `input_tokens`/`output_tokens` (OpenAI Responses, Anthropic).
    fn of(usage: Option<&Value>) -> Tokens {
        let Some(usage) = usage else {
            return Tokens::default();
        };
        let whole = |name: &str| usage.get(name).and_then(Value::as_u64);
        Tokens {
            input: whole("prompt_tokens").or_else(|| whole("input_tokens")),
            output: whole("completion_tokens").or_else(|| whole("output_tokens")),
            total: whole("total_tokens"),
        }
    }

    fn is_empty(&self) -> bool {
        self.input.is_none() && self.output.is_none() && self.total.is_none()
    }

    fn cost(&self, weights: Weights) -> Option<u64> {
        if self.input.is_none() && self.output.is_none() {
            return self
                .total
                .map(|total| total.saturating_mul(weights.input.max(weights.output)));
        }
        let input = self.input.unwrap_or(0).saturating_mul(weights.input);
        let output = self.output.unwrap_or(0).saturating_mul(weights.output);
        Some(input.saturating_add(output))
    }
}

impl Reading {
    fn new(reader: Reader) -> Self {
        Reading {
            reader,
            sum: None,
            tokens: Tokens::default(),
        }
    }

    /// Reads a whole JSON body, given its top-level members (at least those
    /// the reader wants).
    fn body(&mut self, members: &Map<String, Value>) {
        match &self.reader {
            Reader::Json(paths) => self.sum = sum_paths(paths, members),
            Reader::OpenAi(_) | Reader::Anthropic(_) => {
                self.tokens = Tokens::of(members.get("usage"));
            }
        }
    }

    /// Reads one event of a stream, given the top-level members of its data
    /// (at least those the reader wants) and its `event:` type.
    fn event(&mut self, data: &Map<String, Value>, event_type: &str) {
        let kind = data
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or(event_type);
        match &self.reader {
            Reader::Json(paths) => {
                if let Some(sum) = sum_paths(paths, data) {
                    self.sum = Some(sum);
                }
            }
            Reader::OpenAi(_) => {
                let usage = match kind {
                    "response.completed" | "response.incomplete" | "response.failed" => data
                        .get("response")
                        .and_then(|response| response.get("usage")),
                    _ => data.get("usage"),
                };
                let tokens = Tokens::of(usage);
                if !tokens.is_empty() {
                    self.tokens = tokens;
                }
            }
            Reader::Anthropic(_) => match kind {
                "message_start" => {
                    let usage = data.get("message").and_then(|message| message.get("usage"));
                    let tokens = Tokens::of(usage);
                    if tokens.input.is_some() {
                        self.tokens.input = tokens.input;
                    }
                    if tokens.output.is_some() {
                        self.tokens.output = tokens.output;
                    }
                }
                "message_delta" => {
                    let tokens = Tokens::of(data.get("usage"));
                    // The output count is cumulative: the last one is the total.
                    if tokens.output.is_some() {
                        self.tokens.output = tokens.output;
                    }
                    if let Some(input) = tokens.input {
                        self.tokens.input = Some(self.tokens.input.map_or(input, |i| i.max(input)));
                    }
                }
                _ => {}
            },
        }
    }

    fn result(&self) -> Option<u64> {
        match &self.reader {
            Reader::Json(_) => self.sum,
            Reader::OpenAi(weights) | Reader::Anthropic(weights) => self.tokens.cost(*weights),
        }
    }
}

/// The sum of the whole numbers at `paths`, or `None` if none is found.
fn sum_paths(paths: &[Vec<String>], members: &Map<String, Value>) -> Option<u64> {
    paths
        .iter()
        .filter_map(|path| whole_at(members, path))
        .fold(None, |sum, n| Some(sum.unwrap_or(0_u64).saturating_add(n)))
}

/// The whole number at `path` (member names from the top level down).
fn whole_at(members: &Map<String, Value>, path: &[String]) -> Option<u64> {
    let (first, rest) = path.split_first()?;
    let mut value = members.get(first)?;
    for name in rest {
        value = value.get(name.as_str())?;
    }
    value.as_u64()
}

/// Appends to a held buffer, growing it no further than [`MAX_HELD`]; the
/// caller has checked that the bytes fit.
fn hold(buf: &mut Vec<u8>, bytes: &[u8]) {
    let needed = buf.len() + bytes.len();
    if needed > buf.capacity() {
        let target = (buf.capacity() * 2)
            .clamp(MIN_CAPACITY, MAX_HELD)
            .max(needed);
        buf.reserve_exact(target - buf.len());
    }
    buf.extend_from_slice(bytes);
}

/// Empties a held buffer once its piece is read, giving a large one back.
fn release(buf: &mut Vec<u8>) {
    if buf.capacity() > KEEP_CAPACITY {
        *buf = Vec::new();
    } else {
        buf.clear();
    }
}

/// An event stream cut into events, one line at a time.
#[derive(Debug)]
struct Events {
    line: Line,
    /// The last byte seen ended a line with a CR: a LF right after it is
    /// part of that line end.
    after_cr: bool,
    /// The event's data lines, joined with LF.
    data: Vec<u8>,
    /// The event has had a data line (its data may still be empty).
    has_data: bool,
    /// The event outgrew [`MAX_HELD`]: its data is dropped and it is not read.
    too_long: bool,
    /// The event's `event:` type, cut at one byte over [`MAX_EVENT_TYPE`].
    event_type: Vec<u8>,
    /// Reads each event's data.
    scanner: Scanner,
}

/// Where the current line of an event stream is.
#[derive(Debug, Clone, Copy)]
enum Line {
    /// Nothing of it seen yet.
    Start,
    /// In a field's name: its first bytes, as many as the longest name read.
    Name { name: [u8; 5], len: usize },
    /// Right after a field's colon: a single space here is dropped.
    ValueStart(Field),
    /// In a field's value.
    Value(Field),
    /// In a comment, or a field that is not read: up to the line's end.
    Skip,
}

/// The fields of an event that are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    Data,
    Event,
}

fn field_named(name: &[u8]) -> Option<Field> {
    match name {
        b"data" => Some(Field::Data),
        b"event" => Some(Field::Event),
        _ => None,
    }
}

impl Events {
    fn new(scanner: Scanner) -> Self {
        Events {
            line: Line::Start,
            after_cr: false,
            data: Vec::new(),
            has_data: false,
            too_long: false,
            event_type: Vec::new(),
            scanner,
        }
    }

    fn feed(&mut self, chunk: &[u8], reading: &mut Reading) {
        let mut at = 0;
        while at < chunk.len() {
            if self.after_cr {
                self.after_cr = false;
                if chunk[at] == b'\n' {
                    at += 1;
                    continue;
                }
            }
            match self.line {
                Line::Value(_) | Line::Skip => {
                    // The bulk of a stream: a value or comment up to its line end.
                    let rest = &chunk[at..];
                    let end = memchr2(b'\n', b'\r', rest).unwrap_or(rest.len());
                    if let Line::Value(field) = self.line {
                        self.value(field, &rest[..end]);
                    }
                    at += end;
                    if let Some(&line_end) = rest.get(end) {
                        self.end_line(line_end, reading);
                        at += 1;
                    }
                }
                Line::Start | Line::Name { .. } | Line::ValueStart(_) => {
                    let byte = chunk[at];
                    at += 1;
                    if byte == b'\n' || byte == b'\r' {
                        self.end_line(byte, reading);
                    } else {
                        self.step(byte);
                    }
                }
            }
        }
    }

    /// One byte of a line, not a line end.
    fn step(&mut self, byte: u8) {
        self.line = match self.line {
            Line::Start if byte == b':' => Line::Skip,
            Line::Start => Line::Name {
                name: [byte, 0, 0, 0, 0],
                len: 1,
            },
            Line::Name { name, len } if byte == b':' => match field_named(&name[..len]) {
                Some(field) => {
                    self.begin(field);
                    Line::ValueStart(field)
                }
                None => Line::Skip,
            },
            Line::Name { mut name, len } => {
                if len < name.len() {
                    name[len] = byte;
                    Line::Name { name, len: len + 1 }
                } else {
                    Line::Skip
                }
            }
            Line::ValueStart(field) => {
                if byte != b' ' {
                    self.value(field, &[byte]);
                }
                Line::Value(field)
            }
            Line::Value(field) => {
                self.value(field, &[byte]);
                Line::Value(field)
            }
            Line::Skip => Line::Skip,
        };
    }

    fn end_line(&mut self, line_end: u8, reading: &mut Reading) {
        self.after_cr = line_end == b'\r';
        match self.line {
            Line::Start => self.dispatch(reading),
            // A field without a colon: its value is empty.
            Line::Name { name, len } => {
                if let Some(field) = field_named(&name[..len]) {
                    self.begin(field);
                }
            }
            Line::ValueStart(_) | Line::Value(_) | Line::Skip => {}
        }
        self.line = Line::Start;
    }

    /// A field read starts.
    fn begin(&mut self, field: Field) {
        match field {
            Field::Data => {
                if self.has_data {
                    self.value(Field::Data, b"\n");
                }
                self.has_data = true;
            }
            Field::Event => self.event_type.clear(),
        }
    }

    /// More of a field's value.
    fn value(&mut self, field: Field, bytes: &[u8]) {
        match field {
            Field::Data => {
                if self.too_long || bytes.is_empty() {
                    return;
                }
                if self.data.len() + bytes.len() > MAX_HELD {
                    self.too_long = true;
                    self.data = Vec::new();
                    return;
                }
                hold(&mut self.data, bytes);
            }
            Field::Event => {
                let room = (MAX_EVENT_TYPE + 1).saturating_sub(self.event_type.len());
                self.event_type
                    .extend_from_slice(&bytes[..bytes.len().min(room)]);
            }
        }
    }

    /// A blank line: the event is read, unless it had no data or too much.
    fn dispatch(&mut self, reading: &mut Reading) {
        if self.has_data && !self.too_long && !self.scanner.nothing_wanted(&self.data) {
            self.scanner.reset();
            self.scanner.feed(&self.data);
            if self.scanner.is_done() {
                let event_type = if self.event_type.len() <= MAX_EVENT_TYPE {
                    std::str::from_utf8(&self.event_type).unwrap_or("")
                } else {
                    ""
                };
                reading.event(&self.scanner.members, event_type);
            }
        }
        release(&mut self.data);
        self.has_data = false;
        self.too_long = false;
        self.event_type.clear();
    }

    /// The body ended normally: a last line without its line end is a line,
    /// and a last event without its blank line is an event.
    fn end(&mut self, reading: &mut Reading) {
        if !matches!(self.line, Line::Start) {
            self.end_line(b'\n', reading);
        }
        self.dispatch(reading);
    }
}

/// A JSON object's top-level members, scanned as its bytes arrive, with the
/// values of the wanted ones held and parsed.
#[derive(Debug)]
struct Scanner {
    state: State,
    /// The names of the members whose values are read.
    wanted: Vec<String>,
    /// Each of them quoted (`"usage"`), to look for in an event's data.
    quoted: Vec<memchr::memmem::Finder<'static>>,
    /// Whether a wanted name holds a byte JSON writes with a short escape
    /// (`"`, `\`, `/` or a control byte): then any escape may spell it.
    escapable: bool,
    /// The longest of them, in bytes: a longer name is not decoded further.
    longest: usize,
    /// The current member's name, decoded.
    name: Vec<u8>,
    /// The name outgrew `longest`.
    name_long: bool,
    /// Where the name's decoding is in an escape.
    name_escape: NameEscape,
    /// A high surrogate escaped in the name, waiting for its low half.
    high: Option<u16>,
    /// The current member is `wanted[member]`: its value is held.
    member: Option<usize>,
    /// The held value's bytes so far.
    held: Vec<u8>,
    /// The held value outgrew [`MAX_HELD`]: it is read as absent.
    overflow: bool,
    /// Open arrays and objects inside the current value.
    depth: u32,
    /// Bit `d` is set when the container at depth `d + 1` is an array.
    arrays: u128,
    /// Inside a string within the current array or object.
    in_string: bool,
    /// Inside a string, right after a backslash: the next byte is escaped.
    escaped: bool,
    /// The wanted members read, the last of each name; a member whose value
    /// is null or could not be held is left out.
    members: Map<String, Value>,
}

/// Where the scanner is in the top-level object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before its `{`.
    Start,
    /// After its `{` (`first`: a `}` may close it at once) or after a `,`.
    BeforeName { first: bool },
    /// In a member's name.
    Name,
    /// After a name, before its `:`.
    AfterName,
    /// After a `:`, before the value.
    BeforeValue,
    /// In a value that is a string.
    InString,
    /// In a value that is an array or an object.
    InContainer,
    /// In a value that is a number or a literal.
    InScalar,
    /// After a value, before a `,` or the closing `}`.
    AfterValue,
    /// After the closing `}`: only whitespace may follow.
    Done,
    /// Not a JSON object: nothing is read.
    Broken,
}

/// Where a member name's decoding is in an escape sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NameEscape {
    Plain,
    /// After a backslash.
    Backslash,
    /// In `\uXXXX`: the hex digits read so far and their value.
    Hex {
        digits: u8,
        unit: u16,
    },
}

fn is_whitespace(byte: u8) -> bool {
    matches!(byte, b' ' | b'\t' | b'\n' | b'\r')
}

/// A byte that may continue a number or a literal.
fn is_scalar_byte(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'+' | b'.')
}

impl Scanner {
    fn new(wanted: Vec<String>) -> Self {
        let longest = wanted.iter().map(String::len).max().unwrap_or(0);
        let quoted = wanted
            .iter()
            .map(|name| memchr::memmem::Finder::new(format!("\"{name}\"").as_bytes()).into_owned())
            .collect();
        let escapable = wanted.iter().any(|name| {
            name.bytes()
                .any(|b| matches!(b, b'"' | b'\\' | b'/') || b < 0x20)
        });
        Scanner {
            state: State::Start,
            wanted,
            quoted,
            escapable,
            longest,
            name: Vec::new(),
            name_long: false,
            name_escape: NameEscape::Plain,
            high: None,
            member: None,
            held: Vec::new(),
            overflow: false,
            depth: 0,
            arrays: 0,
            in_string: false,
            escaped: false,
            members: Map::new(),
        }
    }

    /// Whether `data` certainly holds no wanted member but null ones, so
    /// that scanning it would read nothing: no escape that could spell a
    /// wanted name (a `\u` escape, or any escape when a name holds a byte
    /// with a short one), and every quoted occurrence of a wanted name
    /// followed by `: null`. A quoted name inside a string is escaped
    /// (`\"usage\"`) and never matches. Most events of a stream (OpenAI's
    /// chunks carry `"usage":null`) are passed so, with a few byte
    /// searches; any doubt scans the event.
    fn nothing_wanted(&self, data: &[u8]) -> bool {
        // Most events have no escape at all: one byte search says so.
        if memchr::memchr(b'\\', data).is_some()
            && (self.escapable || memchr::memmem::find(data, b"\\u").is_some())
        {
            return false;
        }
        self.quoted.iter().all(|name| {
            name.find_iter(data).all(|at| {
                let rest = &data[at + name.needle().len()..];
                let rest = rest.trim_ascii_start();
                rest.strip_prefix(b":")
                    .is_some_and(|v| v.trim_ascii_start().starts_with(b"null"))
            })
        })
    }

    /// Ready for another object, keeping the buffers.
    fn reset(&mut self) {
        self.state = State::Start;
        self.member = None;
        self.overflow = false;
        self.held.clear();
        self.members.clear();
    }

    /// The object closed, and nothing but whitespace followed.
    fn is_done(&self) -> bool {
        self.state == State::Done
    }

    fn feed(&mut self, bytes: &[u8]) {
        let mut at = 0;
        while at < bytes.len() {
            at = match self.state {
                State::Name => self.name_bytes(bytes, at),
                State::InString | State::InContainer | State::InScalar => {
                    let (end, ended) = match self.state {
                        State::InString => self.string_end(bytes, at),
                        State::InContainer => self.container_end(bytes, at),
                        _ => scalar_end(bytes, at),
                    };
                    if self.state == State::Broken {
                        return;
                    }
                    self.keep(&bytes[at..end]);
                    if ended {
                        self.value_end();
                    }
                    end
                }
                State::Broken => return,
                State::Start
                | State::BeforeName { .. }
                | State::AfterName
                | State::BeforeValue
                | State::AfterValue
                | State::Done => {
                    self.structural(bytes[at]);
                    at + 1
                }
            };
        }
    }

    /// One byte between the top-level object's names and values.
    fn structural(&mut self, byte: u8) {
        if is_whitespace(byte) {
            return;
        }
        self.state = match (self.state, byte) {
            (State::Start, b'{') => State::BeforeName { first: true },
            (State::BeforeName { first: true }, b'}') | (State::AfterValue, b'}') => State::Done,
            (State::BeforeName { .. }, b'"') => {
                self.name.clear();
                self.name_long = false;
                self.name_escape = NameEscape::Plain;
                self.high = None;
                State::Name
            }
            (State::AfterName, b':') => State::BeforeValue,
            (State::BeforeValue, _) => self.value_start(byte),
            (State::AfterValue, b',') => State::BeforeName { first: false },
            _ => State::Broken,
        };
    }

    /// The first byte of a member's value.
    fn value_start(&mut self, byte: u8) -> State {
        let state = match byte {
            b'"' => {
                self.escaped = false;
                State::InString
            }
            b'{' | b'[' => {
                self.depth = 1;
                self.arrays = u128::from(byte == b'[');
                self.in_string = false;
                self.escaped = false;
                State::InContainer
            }
            b'-' | b'0'..=b'9' | b't' | b'f' | b'n' => State::InScalar,
            _ => return State::Broken,
        };
        self.keep(&[byte]);
        state
    }

    /// The end of a string value, past its closing quote, if it is in `bytes`.
    fn string_end(&mut self, bytes: &[u8], mut at: usize) -> (usize, bool) {
        loop {
            if self.escaped {
                if at >= bytes.len() {
                    return (at, false);
                }
                self.escaped = false;
                at += 1;
            }
            match memchr2(b'"', b'\\', &bytes[at..]) {
                None => return (bytes.len(), false),
                Some(found) if bytes[at + found] == b'"' => return (at + found + 1, true),
                Some(found) => {
                    self.escaped = true;
                    at += found + 1;
                }
            }
        }
    }

    /// The end of an array or object value, past its closing bracket, if it
    /// is in `bytes`.
    fn container_end(&mut self, bytes: &[u8], mut at: usize) -> (usize, bool) {
        while at < bytes.len() {
            if self.in_string {
                let (end, closed) = self.string_end(bytes, at);
                self.in_string = !closed;
                at = end;
                continue;
            }
            let byte = bytes[at];
            at += 1;
            match byte {
                b'"' => self.in_string = true,
                b'{' | b'[' => {
                    if self.depth >= MAX_DEPTH {
                        self.state = State::Broken;
                        return (at, false);
                    }
                    if byte == b'[' {
                        self.arrays |= 1 << self.depth;
                    } else {
                        self.arrays &= !(1 << self.depth);
                    }
                    self.depth += 1;
                }
                b'}' | b']' => {
                    self.depth -= 1;
                    let array = self.arrays & (1 << self.depth) != 0;
                    if array != (byte == b']') {
                        self.state = State::Broken;
                        return (at, false);
                    }
                    if self.depth == 0 {
                        return (at, true);
                    }
                }
                _ => {}
            }
        }
        (at, false)
    }

    /// Holds more of the current value, if it is wanted and still fits.
    fn keep(&mut self, bytes: &[u8]) {
        if self.member.is_none() || self.overflow || bytes.is_empty() {
            return;
        }
        if self.held.len() + bytes.len() > MAX_HELD {
            self.overflow = true;
            self.held = Vec::new();
            return;
        }
        hold(&mut self.held, bytes);
    }

    /// A member's value ended: a wanted one is parsed and kept.
    fn value_end(&mut self) {
        self.state = State::AfterValue;
        let Some(index) = self.member.take() else {
            return;
        };
        let name = &self.wanted[index];
        if self.overflow {
            self.members.remove(name);
        } else {
            match serde_json::from_slice::<Value>(&self.held) {
                Ok(Value::Null) => {
                    self.members.remove(name);
                }
                Ok(value) => {
                    self.members.insert(name.clone(), value);
                }
                Err(_) => self.state = State::Broken,
            }
        }
        self.overflow = false;
        release(&mut self.held);
    }

    /// Decodes a member name's bytes up to its closing quote; returns where
    /// the scan goes on.
    fn name_bytes(&mut self, bytes: &[u8], mut at: usize) -> usize {
        while at < bytes.len() {
            let byte = bytes[at];
            at += 1;
            let decoded = match self.name_escape {
                NameEscape::Plain => {
                    if self.high.is_some() && byte != b'\\' {
                        // A high surrogate must be followed by its low half.
                        return self.broken(bytes);
                    }
                    match byte {
                        b'"' => {
                            self.name_end();
                            return at;
                        }
                        b'\\' => {
                            self.name_escape = NameEscape::Backslash;
                            continue;
                        }
                        0x00..=0x1f => return self.broken(bytes),
                        _ => byte,
                    }
                }
                NameEscape::Backslash => {
                    self.name_escape = NameEscape::Plain;
                    if self.high.is_some() && byte != b'u' {
                        return self.broken(bytes);
                    }
                    match byte {
                        b'"' | b'\\' | b'/' => byte,
                        b'b' => 0x08,
                        b'f' => 0x0c,
                        b'n' => b'\n',
                        b'r' => b'\r',
                        b't' => b'\t',
                        b'u' => {
                            self.name_escape = NameEscape::Hex { digits: 0, unit: 0 };
                            continue;
                        }
                        _ => return self.broken(bytes),
                    }
                }
                NameEscape::Hex { digits, unit } => {
                    let Some(digit) = char::from(byte).to_digit(16) else {
                        return self.broken(bytes);
                    };
                    // Four hex digits: at most 0xFFFF.
                    let unit = (unit << 4) | digit as u16;
                    if digits < 3 {
                        self.name_escape = NameEscape::Hex {
                            digits: digits + 1,
                            unit,
                        };
                    } else {
                        self.name_escape = NameEscape::Plain;
                        if !self.code_unit(unit) {
                            return self.broken(bytes);
                        }
                    }
                    continue;
                }
            };
            self.name_push(&[decoded]);
        }
        at
    }

    /// A UTF-16 code unit escaped in a name; false if it breaks the pairing
    /// of surrogates.
    fn code_unit(&mut self, unit: u16) -> bool {
        let code = match (self.high.take(), unit) {
            (Some(high), 0xDC00..=0xDFFF) => {
                0x10000 + ((u32::from(high) - 0xD800) << 10) + (u32::from(unit) - 0xDC00)
            }
            (Some(_), _) | (None, 0xDC00..=0xDFFF) => return false,
            (None, 0xD800..=0xDBFF) => {
                self.high = Some(unit);
                return true;
            }
            (None, _) => u32::from(unit),
        };
        let Some(decoded) = char::from_u32(code) else {
            return false;
        };
        self.name_push(decoded.encode_utf8(&mut [0; 4]).as_bytes());
        true
    }

    fn name_push(&mut self, bytes: &[u8]) {
        if self.name_long {
            return;
        }
        if self.name.len() + bytes.len() > self.longest {
            self.name_long = true;
            return;
        }
        self.name.extend_from_slice(bytes);
    }

    fn name_end(&mut self) {
        self.member = if self.name_long {
            None
        } else {
            let name = self.name.as_slice();
            self.wanted
                .iter()
                .position(|wanted| wanted.as_bytes() == name)
        };
        self.overflow = false;
        self.state = State::AfterName;
    }

    /// The body is not a JSON object: the scan stops.
    fn broken(&mut self, bytes: &[u8]) -> usize {
        self.state = State::Broken;
        bytes.len()
    }
}

/// The end of a number or literal, before the byte that ends it, if it is in
/// `bytes`.
fn scalar_end(bytes: &[u8], at: usize) -> (usize, bool) {
    match bytes[at..].iter().position(|&byte| !is_scalar_byte(byte)) {
        Some(found) => (at + found, true),
        None => (bytes.len(), false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn openai() -> Reader {
        Reader::OpenAi(Weights::default())
    }

    fn anthropic() -> Reader {
        Reader::Anthropic(Weights::default())
    }

    fn paths(list: &[&[&str]]) -> Reader {
        Reader::Json(
            list.iter()
                .map(|path| path.iter().map(|name| name.to_string()).collect())
                .collect(),
        )
    }

    /// The meter's reading of `chunks`, with `held()` checked after each.
    fn read(reader: &Reader, stream: bool, chunks: &[&[u8]], complete: bool) -> Option<u64> {
        let mut meter = Meter::new(reader.clone(), stream);
        for chunk in chunks {
            meter.feed(chunk);
            assert!(meter.held() <= MAX_HELD, "held {} bytes", meter.held());
        }
        meter.finish(complete)
    }

    fn read_whole(reader: &Reader, stream: bool, body: &[u8]) -> Option<u64> {
        read(reader, stream, &[body], true)
    }

    /// Reads `body` whole, split in two at every offset, and byte by byte,
    /// and checks every reading against `expected`.
    fn every_split(reader: &Reader, stream: bool, body: &[u8], expected: Option<u64>) {
        assert_eq!(read_whole(reader, stream, body), expected, "whole");
        for split in 0..=body.len() {
            let (head, tail) = body.split_at(split);
            assert_eq!(
                read(reader, stream, &[head, tail], true),
                expected,
                "split at {split}"
            );
        }
        let bytes: Vec<&[u8]> = body.chunks(1).collect();
        assert_eq!(read(reader, stream, &bytes, true), expected, "byte by byte");
    }

    /// `text` with its line ends made `line_end`.
    fn with_line_ends(text: &str, line_end: &str) -> Vec<u8> {
        text.replace('\n', line_end).into_bytes()
    }

    const OPENAI_STREAM: &str = concat!(
        "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,",
        "\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}],\"usage\":null}\n",
        "\n",
        "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,",
        "\"delta\":{\"content\":\"H\u{e9} {\\\"usage\\\": {\\\"total_tokens\\\": 999999}}\"}}],",
        "\"usage\":null}\n",
        "\n",
        "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,",
        "\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":null}\n",
        "\n",
        "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[],",
        "\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":30,\"total_tokens\":42}}\n",
        "\n",
        "data: [DONE]\n",
        "\n",
    );

    const RESPONSES_STREAM: &str = concat!(
        "event: response.created\n",
        "data: {\"type\":\"response.created\",\"response\":{\"id\":\"r1\",\"object\":\"response\",",
        "\"status\":\"in_progress\",\"usage\":null}}\n",
        "\n",
        "event: response.output_text.delta\n",
        "data: {\"type\":\"response.output_text.delta\",\"delta\":\"usage: 5\"}\n",
        "\n",
        "event: response.completed\n",
        "data: {\"type\":\"response.completed\",\"response\":{\"id\":\"r1\",\"object\":\"response\",",
        "\"status\":\"completed\",\"output\":[{\"type\":\"message\",\"content\":[{\"type\":",
        "\"output_text\",\"text\":\"Hi\"}]}],",
        "\"usage\":{\"input_tokens\":20,\"output_tokens\":7,\"total_tokens\":27}}}\n",
        "\n",
    );

    const ANTHROPIC_STREAM: &str = concat!(
        "event: message_start\n",
        "data: {\"type\":\"message_start\",\"message\":{\"id\":\"m1\",\"type\":\"message\",",
        "\"role\":\"assistant\",\"content\":[],\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n",
        "\n",
        "event: content_block_start\n",
        "data: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",",
        "\"text\":\"\"}}\n",
        "\n",
        "event: ping\n",
        "data: {\"type\": \"ping\"}\n",
        "\n",
        "event: content_block_delta\n",
        "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",",
        "\"text\":\"{\\\"usage\\\":{\\\"output_tokens\\\":999}}\"}}\n",
        "\n",
        "event: message_delta\n",
        "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":null},",
        "\"usage\":{\"output_tokens\":9}}\n",
        "\n",
        "event: message_delta\n",
        "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},",
        "\"usage\":{\"output_tokens\":17}}\n",
        "\n",
        "event: message_stop\n",
        "data: {\"type\":\"message_stop\"}\n",
        "\n",
    );

    #[test]
    fn openai_stream_reads_the_usage_chunk() {
        assert_eq!(
            read_whole(&openai(), true, OPENAI_STREAM.as_bytes()),
            Some(42)
        );
        let weighed = Reader::OpenAi(Weights {
            input: 2,
            output: 3,
        });
        assert_eq!(
            read_whole(&weighed, true, OPENAI_STREAM.as_bytes()),
            Some(12 * 2 + 30 * 3)
        );
    }

    #[test]
    fn openai_stream_without_usage_reads_none() {
        let stream = concat!(
            "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"\\\"usage\\\":{}\"}}],\"usage\":null}\n\n",
            "data: [DONE]\n\n",
        );
        assert_eq!(read_whole(&openai(), true, stream.as_bytes()), None);
    }

    #[test]
    fn responses_stream_reads_response_completed() {
        assert_eq!(
            read_whole(&openai(), true, RESPONSES_STREAM.as_bytes()),
            Some(27)
        );
        let weighed = Reader::OpenAi(Weights {
            input: 1,
            output: 4,
        });
        assert_eq!(
            read_whole(&weighed, true, RESPONSES_STREAM.as_bytes()),
            Some(20 + 7 * 4)
        );
    }

    #[test]
    fn anthropic_stream_takes_the_last_message_delta() {
        assert_eq!(
            read_whole(&anthropic(), true, ANTHROPIC_STREAM.as_bytes()),
            Some(25 + 17)
        );
        let weighed = Reader::Anthropic(Weights {
            input: 1,
            output: 5,
        });
        assert_eq!(
            read_whole(&weighed, true, ANTHROPIC_STREAM.as_bytes()),
            Some(25 + 17 * 5)
        );
    }

    #[test]
    fn anthropic_message_delta_input_tokens_take_the_larger() {
        let stream = concat!(
            "data: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,",
            "\"output_tokens\":1}}}\n\n",
            "data: {\"type\":\"message_delta\",\"usage\":{\"input_tokens\":40,\"output_tokens\":3}}\n\n",
            "data: {\"type\":\"message_delta\",\"usage\":{\"input_tokens\":30,\"output_tokens\":8}}\n\n",
        );
        assert_eq!(
            read_whole(&anthropic(), true, stream.as_bytes()),
            Some(40 + 8)
        );
    }

    #[test]
    fn event_type_stands_in_for_a_missing_type_member() {
        let stream = "event: message_delta\ndata: {\"usage\":{\"output_tokens\":8}}\n\n";
        assert_eq!(read_whole(&anthropic(), true, stream.as_bytes()), Some(8));
        let untyped = "data: {\"usage\":{\"output_tokens\":8}}\n\n";
        assert_eq!(read_whole(&anthropic(), true, untyped.as_bytes()), None);
    }

    #[test]
    fn streams_split_anywhere_with_any_line_end() {
        let cases = [
            (openai(), OPENAI_STREAM, Some(42)),
            (openai(), RESPONSES_STREAM, Some(27)),
            (anthropic(), ANTHROPIC_STREAM, Some(42)),
            (
                paths(&[&["usage", "total_tokens"]]),
                OPENAI_STREAM,
                Some(42),
            ),
        ];
        for (reader, stream, expected) in &cases {
            for line_end in ["\n", "\r\n", "\r"] {
                let body = with_line_ends(stream, line_end);
                every_split(reader, true, &body, *expected);
                let mut with_bom = BOM.to_vec();
                with_bom.extend_from_slice(&body);
                every_split(reader, true, &with_bom, *expected);
            }
        }
    }

    #[test]
    fn comments_fields_and_multiline_data() {
        let stream = concat!(
            ": a comment\n",
            "retry: 1000\n",
            "id: 7\n",
            "unknown: {\"usage\":{\"total_tokens\":99}}\n",
            "data:{\"choices\":[],\n",
            ":another\n",
            "data: \"usage\":{\"prompt_tokens\":1,\n",
            "data:  \"completion_tokens\":2}}\n",
            "\n",
            "data\n",
            "\n",
        );
        for line_end in ["\n", "\r\n", "\r"] {
            every_split(&openai(), true, &with_line_ends(stream, line_end), Some(3));
        }
    }

    #[test]
    fn a_byte_order_mark_prefix_that_is_not_one_is_kept() {
        // A body starting with the first bytes of one only: they are kept,
        // and break the JSON or the first line's field name.
        let json = b"{\"usage\":{\"total_tokens\":4}}";
        assert_eq!(read(&openai(), false, &[b"\xEF", json], true), None);
        assert_eq!(read(&openai(), false, &[b"\xEF\xBB", json], true), None);
        let event = b"data: {\"usage\":{\"total_tokens\":4}}\n\n";
        assert_eq!(read(&openai(), true, &[b"\xEF\xBB", event], true), None);
        assert_eq!(
            read(&openai(), true, &[b"\xEF\xBB", b"\xBF", event], true),
            Some(4)
        );
        let body = b"\xEF\xBB\xBF{\"usage\":{\"total_tokens\":4}}";
        every_split(&openai(), false, body, Some(4));
    }

    #[test]
    fn an_over_long_event_is_skipped_and_the_next_one_read() {
        let pad = "x".repeat(MAX_HELD + 10);
        let stream = format!(
            "data: {{\"choices\":[],\"usage\":{{\"total_tokens\":5}},\"pad\":\"{pad}\"}}\n\n\
             data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":1,\"completion_tokens\":2}}}}\n\n"
        );
        let chunks: Vec<&[u8]> = stream.as_bytes().chunks(4096).collect();
        assert_eq!(read(&openai(), true, &chunks, true), Some(3));
        // Split across data lines, still too long.
        let half = "x".repeat(MAX_HELD / 2 + 10);
        let stream = format!(
            "data: {{\"usage\":{{\"total_tokens\":5}},\"a\":\"{half}\",\n\
             data: \"b\":\"{half}\"}}\n\n"
        );
        let chunks: Vec<&[u8]> = stream.as_bytes().chunks(1000).collect();
        assert_eq!(read(&openai(), true, &chunks, true), None);
        // An over-long last event leaves the earlier reading.
        let stream = format!(
            "data: {{\"usage\":{{\"total_tokens\":6}}}}\n\n\
             data: {{\"usage\":{{\"total_tokens\":5}},\"pad\":\"{pad}\"}}\n\n"
        );
        let chunks: Vec<&[u8]> = stream.as_bytes().chunks(3000).collect();
        assert_eq!(read(&openai(), true, &chunks, true), Some(6));
    }

    #[test]
    fn a_cut_stream_counts_complete_events_only() {
        let first = "data: {\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2}}\n\n";
        let last = "data: {\"usage\":{\"prompt_tokens\":100,\"completion_tokens\":200}}";
        for line_end in ["\n", "\r\n", "\r"] {
            let body = with_line_ends(&format!("{first}{last}"), line_end);
            assert_eq!(read(&openai(), true, &[&body], false), Some(3));
            assert_eq!(read(&openai(), true, &[&body], true), Some(300));
            let with_line_end = with_line_ends(&format!("{first}{last}\n"), line_end);
            assert_eq!(read(&openai(), true, &[&with_line_end], false), Some(3));
            assert_eq!(read(&openai(), true, &[&with_line_end], true), Some(300));
            // Cut in the middle of the last event's line.
            let cut = &body[..body.len() - 5];
            assert_eq!(read(&openai(), true, &[cut], false), Some(3));
            assert_eq!(read(&openai(), true, &[cut], true), Some(3));
        }
    }

    #[test]
    fn json_bodies_of_each_format() {
        let chat = concat!(
            "{\"id\":\"x\",\"object\":\"chat.completion\",\"choices\":[{\"message\":{\"role\":",
            "\"assistant\",\"content\":\"{\\\"usage\\\": {\\\"total_tokens\\\": 999999}}\"}}],",
            "\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":12,\"total_tokens\":21}}"
        );
        every_split(&openai(), false, chat.as_bytes(), Some(21));
        let weighed = Reader::OpenAi(Weights {
            input: 2,
            output: 3,
        });
        assert_eq!(
            read_whole(&weighed, false, chat.as_bytes()),
            Some(9 * 2 + 12 * 3)
        );

        let responses = concat!(
            "{\"id\":\"r\",\"object\":\"response\",\"output\":[{\"type\":\"message\",",
            "\"content\":[{\"type\":\"output_text\",\"text\":\"usage\"}]}],",
            "\"usage\":{\"input_tokens\":11,\"output_tokens\":4,\"total_tokens\":15}}"
        );
        every_split(&openai(), false, responses.as_bytes(), Some(15));
        assert_eq!(
            read_whole(&weighed, false, responses.as_bytes()),
            Some(11 * 2 + 4 * 3)
        );

        let message = concat!(
            "{\n  \"id\": \"m\",\n  \"type\": \"message\",\n  \"content\": [{\"type\": \"text\", ",
            "\"text\": \"\\\"usage\\\": {\\\"input_tokens\\\": 5000}\"}],\n  \"usage\": {\n",
            "    \"input_tokens\": 10,\n    \"output_tokens\": 5\n  }\n}\n"
        );
        every_split(&anthropic(), false, message.as_bytes(), Some(15));
        let weighed = Reader::Anthropic(Weights {
            input: 3,
            output: 7,
        });
        assert_eq!(
            read_whole(&weighed, false, message.as_bytes()),
            Some(10 * 3 + 5 * 7)
        );

        let custom = "{\"usage\":{\"total_tokens\":21},\"meta\":{\"billed\":4},\"n\":[1]}";
        let reader = paths(&[&["usage", "total_tokens"], &["meta", "billed"], &["n"]]);
        every_split(&reader, false, custom.as_bytes(), Some(25));
        let reader = paths(&[&["usage", "missing"], &["meta", "billed", "deeper"]]);
        assert_eq!(read_whole(&reader, false, custom.as_bytes()), None);
    }

    #[test]
    fn saturating_arithmetic() {
        let body = format!(
            "{{\"usage\":{{\"input_tokens\":{},\"output_tokens\":5}}}}",
            u64::MAX
        );
        let weighed = Reader::Anthropic(Weights {
            input: 2,
            output: 1,
        });
        assert_eq!(read_whole(&weighed, false, body.as_bytes()), Some(u64::MAX));
        let reader = paths(&[&["a"], &["b"]]);
        let body = format!("{{\"a\":{},\"b\":1}}", u64::MAX);
        assert_eq!(read_whole(&reader, false, body.as_bytes()), Some(u64::MAX));
    }

    #[test]
    fn escaped_member_names_are_decoded() {
        let reader = paths(&[&["usage", "total_tokens"]]);
        for body in [
            r#"{"\u0075sage":{"total_tokens":7}}"#,
            r#"{"us\u0061ge":{"total_tokens":7}}"#,
            r#"{"\u0055sage":{"total_tokens":1},"usag\u0065":{"total_tokens":7}}"#,
        ] {
            every_split(&reader, false, body.as_bytes(), Some(7));
        }
        let reader = paths(&[&["\u{1F600}", "n"], &["a\"b/\n", "n"]]);
        let body = r#"{"\ud83d\ude00":{"n":3},"a\"b\/\n":{"n":4}}"#;
        every_split(&reader, false, body.as_bytes(), Some(7));
        // So in an event stream, whose events are passed over unscanned
        // when they cannot hold a wanted name: `\"`, `\/` and `\n` spell
        // one, as `\u` does.
        let event = concat!("data: ", r#"{"a\"b\/\n":{"n":4}}"#, "\n\n");
        every_split(&reader, true, event.as_bytes(), Some(4));
        // Lone or broken surrogates and unknown escapes are not JSON.
        for body in [
            r#"{"\ud83d":{"n":3}}"#,
            r#"{"\ude00":{"n":3}}"#,
            r#"{"\ud83dx":{"n":3}}"#,
            r#"{"\ud83d\u0041":{"n":3}}"#,
            r#"{"\x":{"n":3}}"#,
            r#"{"\u00g1":{"n":3}}"#,
        ] {
            assert_eq!(read_whole(&reader, false, body.as_bytes()), None, "{body}");
        }
    }

    #[test]
    fn usage_inside_strings_or_nested_does_not_match() {
        let reader = paths(&[&["usage", "total_tokens"]]);
        let inside = r#"{"content":"{\"usage\": {\"total_tokens\": 999999}}","x":1}"#;
        assert_eq!(read_whole(&reader, false, inside.as_bytes()), None);
        let nested = concat!(
            r#"{"choices":[{"usage":{"total_tokens":5}}],"data":{"usage":{"total_tokens":6}},"#,
            r#""s":"\\\"usage\":{\"total_tokens\":1}"}"#
        );
        every_split(&reader, false, nested.as_bytes(), None);
        let both = r#"{"data":{"usage":{"total_tokens":6}},"usage":{"total_tokens":2}}"#;
        every_split(&reader, false, both.as_bytes(), Some(2));
    }

    #[test]
    fn a_duplicated_member_takes_the_later_value() {
        let reader = paths(&[&["usage", "total_tokens"]]);
        let body = r#"{"usage":{"total_tokens":1},"usage":{"total_tokens":2}}"#;
        assert_eq!(read_whole(&reader, false, body.as_bytes()), Some(2));
        let body = r#"{"usage":{"total_tokens":1},"usage":null}"#;
        assert_eq!(read_whole(&reader, false, body.as_bytes()), None);
        assert_eq!(read_whole(&openai(), false, body.as_bytes()), None);
    }

    #[test]
    fn non_whole_numbers_are_absent() {
        let reader = paths(&[&["usage", "total_tokens"]]);
        for body in [
            r#"{"usage":{"total_tokens":5.5}}"#,
            r#"{"usage":{"total_tokens":-5}}"#,
            r#"{"usage":{"total_tokens":"5"}}"#,
            r#"{"usage":{"total_tokens":1e3}}"#,
            r#"{"usage":{"total_tokens":null}}"#,
        ] {
            assert_eq!(read_whole(&reader, false, body.as_bytes()), None, "{body}");
        }
        // Only the total is a whole number: charged at the larger weight.
        let body = r#"{"usage":{"prompt_tokens":-3,"completion_tokens":"4","total_tokens":7}}"#;
        let weighed = Reader::OpenAi(Weights {
            input: 2,
            output: 3,
        });
        assert_eq!(read_whole(&weighed, false, body.as_bytes()), Some(21));
        let body = r#"{"usage":{"prompt_tokens":2.5}}"#;
        assert_eq!(read_whole(&openai(), false, body.as_bytes()), None);
    }

    #[test]
    fn broken_json_reads_none() {
        let reader = paths(&[&["usage", "total_tokens"]]);
        let good = r#"{"usage":{"total_tokens":5}}"#;
        assert_eq!(read_whole(&reader, false, good.as_bytes()), Some(5));
        for end in 0..good.len() {
            let cut = &good.as_bytes()[..end];
            assert_eq!(read_whole(&reader, false, cut), None, "cut at {end}");
        }
        for body in [
            r#"{"usage":{"total_tokens":5}} x"#,
            r#"{"usage":{"total_tokens":5}}{}"#,
            r#"{"usage":{"total_tokens":5},}"#,
            r#"{"usage" {"total_tokens":5}}"#,
            r#"{"usage":{"total_tokens":5]}"#,
            r#"{"usage":{"total_tokens":5}"#,
            r#"{"usage":{"total_tokens":5x}}"#,
            r#"{"usage":{"total_tokens":5},"a":[}"#,
            r#"{"usage":{"total_tokens":5},"a":}"#,
            r#"{"usage":{"total_tokens":5},"a":1 2}"#,
            r#"{"usage":{"total_tokens":5},"a"}"#,
            r#"{"usage":{"total_tokens":5},,"a":1}"#,
            r#"[{"usage":{"total_tokens":5}}]"#,
            "{\"usage\":{\"total_tokens\":5},\"a\x01\":1}",
            "data: {\"usage\":{\"total_tokens\":5}}\n\n",
            "",
        ] {
            assert_eq!(read_whole(&reader, false, body.as_bytes()), None, "{body}");
        }
        // Too deep for serde_json is too deep here.
        let deep = format!(
            "{{\"a\":{}{},\"usage\":{{\"total_tokens\":5}}}}",
            "[".repeat(200),
            "]".repeat(200)
        );
        assert_eq!(read_whole(&reader, false, deep.as_bytes()), None);
        let deep_enough = format!(
            "{{\"a\":{}{},\"usage\":{{\"total_tokens\":5}}}}",
            "[".repeat(127),
            "]".repeat(127)
        );
        assert_eq!(read_whole(&reader, false, deep_enough.as_bytes()), Some(5));
    }

    #[test]
    fn a_held_value_over_the_bound_is_absent() {
        let pad = "y".repeat(MAX_HELD);
        let reader = paths(&[&["usage", "total_tokens"], &["other", "n"]]);
        let body = format!(r#"{{"usage":{{"total_tokens":5,"pad":"{pad}"}},"other":{{"n":2}}}}"#);
        let chunks: Vec<&[u8]> = body.as_bytes().chunks(1000).collect();
        assert_eq!(read(&reader, false, &chunks, true), Some(2));
        // A later duplicate too large to hold replaces the earlier one.
        let body = format!(
            r#"{{"usage":{{"total_tokens":5}},"usage":{{"total_tokens":6,"pad":"{pad}"}}}}"#
        );
        let chunks: Vec<&[u8]> = body.as_bytes().chunks(777).collect();
        assert_eq!(read(&reader, false, &chunks, true), None);
        // One that just fits is read.
        let fits = "y".repeat(MAX_HELD - r#"{"total_tokens":6,"pad":""}"#.len());
        let body = format!(r#"{{"usage":{{"total_tokens":6,"pad":"{fits}"}}}}"#);
        let (head, tail) = body.as_bytes().split_at(body.len() - 2);
        let mut meter = Meter::new(reader.clone(), false);
        for chunk in head.chunks(1000) {
            meter.feed(chunk);
        }
        // All of it but the closing brace.
        assert_eq!(meter.held(), MAX_HELD - 1);
        meter.feed(tail);
        assert_eq!(meter.held(), 0);
        assert_eq!(meter.finish(true), Some(6));
    }

    #[test]
    fn a_large_body_is_read_holding_only_the_usage() {
        let text = "lorem \\\"ipsum\\\" usage ".repeat(50_000);
        let body = format!(
            r#"{{"choices":[{{"message":{{"content":"{text}"}}}}],"usage":{{"total_tokens":9}}}}"#
        );
        let mut meter = Meter::new(openai(), false);
        for chunk in body.as_bytes().chunks(16 * 1024) {
            meter.feed(chunk);
            assert!(meter.held() < 64, "held {}", meter.held());
        }
        assert_eq!(meter.finish(true), Some(9));
    }

    #[test]
    fn held_counts_the_partial_event() {
        let mut meter = Meter::new(openai(), true);
        meter.feed(b"data: {\"usage\":");
        assert_eq!(meter.held(), b"{\"usage\":".len());
        meter.feed(b"{\"total_tokens\":3}}\n\n");
        assert_eq!(meter.held(), 0);
        assert_eq!(meter.finish(true), Some(3));
    }

    // The references the property tests check the meter against: the whole
    // body at once, read without any of the meter's incremental machinery.

    /// A JSON body parsed whole by serde_json.
    fn reference_json(reader: &Reader, body: &[u8]) -> Option<u64> {
        let Ok(Value::Object(members)) = serde_json::from_slice::<Value>(body) else {
            return None;
        };
        let mut reading = Reading::new(reader.clone());
        reading.body(&members);
        reading.result()
    }

    /// An event stream split into lines and events the plain way, each
    /// event's data parsed whole by serde_json.
    fn reference_events(reader: &Reader, body: &[u8], complete: bool) -> Option<u64> {
        let body = body.strip_prefix(BOM).unwrap_or(body);
        let mut lines = Vec::new();
        let mut start = 0;
        let mut at = 0;
        while at < body.len() {
            match body[at] {
                b'\r' => {
                    lines.push(&body[start..at]);
                    if body.get(at + 1) == Some(&b'\n') {
                        at += 1;
                    }
                    start = at + 1;
                }
                b'\n' => {
                    lines.push(&body[start..at]);
                    start = at + 1;
                }
                _ => {}
            }
            at += 1;
        }
        let tail = &body[start..];
        if complete && !tail.is_empty() {
            lines.push(tail);
        }
        if complete {
            lines.push(b"");
        }
        let mut reading = Reading::new(reader.clone());
        let mut data: Option<Vec<u8>> = None;
        let mut event_type: Vec<u8> = Vec::new();
        for line in lines {
            if line.is_empty() {
                // Each data line added a LF; the last one is not data.
                let data = data.take().map(|mut data| {
                    data.pop();
                    data
                });
                if let Some(data) = data.filter(|data| data.len() <= MAX_HELD) {
                    if let Ok(Value::Object(members)) = serde_json::from_slice::<Value>(&data) {
                        let event_type = if event_type.len() <= MAX_EVENT_TYPE {
                            std::str::from_utf8(&event_type).unwrap_or("")
                        } else {
                            ""
                        };
                        reading.event(&members, event_type);
                    }
                }
                event_type.clear();
                continue;
            }
            if line[0] == b':' {
                continue;
            }
            let (name, value) = match line.iter().position(|&byte| byte == b':') {
                Some(colon) => {
                    let value = &line[colon + 1..];
                    (&line[..colon], value.strip_prefix(b" ").unwrap_or(value))
                }
                None => (line, &b""[..]),
            };
            match name {
                b"data" => {
                    let data = data.get_or_insert_with(Vec::new);
                    data.extend_from_slice(value);
                    data.push(b'\n');
                }
                b"event" => event_type = value.to_vec(),
                _ => {}
            }
        }
        reading.result()
    }

    #[test]
    fn the_event_reference_agrees_on_the_examples() {
        let examples = [
            (openai(), OPENAI_STREAM, Some(42)),
            (openai(), RESPONSES_STREAM, Some(27)),
            (anthropic(), ANTHROPIC_STREAM, Some(42)),
        ];
        for (reader, stream, expected) in &examples {
            assert_eq!(reference_events(reader, stream.as_bytes(), true), *expected);
        }
    }

    /// Cuts `body` at the given points (taken modulo its length).
    fn cut<'a>(body: &'a [u8], points: &[usize]) -> Vec<&'a [u8]> {
        let mut points: Vec<usize> = points.iter().map(|p| p % (body.len() + 1)).collect();
        points.sort_unstable();
        let mut chunks = Vec::new();
        let mut start = 0;
        for point in points {
            chunks.push(&body[start..point]);
            start = point;
        }
        chunks.push(&body[start..]);
        chunks
    }

    fn any_reader() -> impl Strategy<Value = Reader> {
        let weights = (0_u64..5, 0_u64..5).prop_map(|(input, output)| Weights { input, output });
        prop_oneof![
            weights.clone().prop_map(Reader::OpenAi),
            weights.prop_map(Reader::Anthropic),
            Just(paths(&[
                &["usage", "total_tokens"],
                &["meta", "n"],
                &["\u{1F600}"],
                &["a\"b", "n"],
            ])),
        ]
    }

    const KEYS: &[&str] = &[
        "usage",
        "total_tokens",
        "prompt_tokens",
        "completion_tokens",
        "input_tokens",
        "output_tokens",
        "type",
        "message",
        "response",
        "meta",
        "n",
        "choices",
        "\u{1F600}",
        "a\"b",
        "us\\age",
    ];

    const STRINGS: &[&str] = &[
        "",
        "usage",
        "{\"usage\": {\"total_tokens\": 999999}}",
        "\"usage\":",
        "\\",
        "\\\"",
        "}]",
        "h\u{e9}llo \u{1F600}",
        "\u{1}\n\t",
        "message_delta",
        "message_start",
        "response.completed",
    ];

    fn any_key() -> impl Strategy<Value = String> {
        prop::sample::select(KEYS).prop_map(str::to_string)
    }

    fn any_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            (0_u64..1000).prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            (-1000_i64..0).prop_map(Value::from),
            (-1.0e6_f64..1.0e6).prop_map(Value::from),
            prop::sample::select(STRINGS).prop_map(Value::from),
        ];
        leaf.prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::vec((any_key(), inner), 0..6)
                    .prop_map(|members| Value::Object(members.into_iter().collect())),
            ]
        })
    }

    /// A usage object with some of the names the formats read.
    fn any_usage() -> impl Strategy<Value = Value> {
        let names = [
            "total_tokens",
            "prompt_tokens",
            "completion_tokens",
            "input_tokens",
            "output_tokens",
            "n",
        ];
        prop::collection::vec((prop::sample::select(names.to_vec()), 0_u64..10_000), 0..5).prop_map(
            |members| {
                Value::Object(
                    members
                        .into_iter()
                        .map(|(name, n)| (name.to_string(), Value::from(n)))
                        .collect(),
                )
            },
        )
    }

    /// How a test body writes its JSON.
    #[derive(Debug, Clone, Copy)]
    struct Style {
        /// 0: only what must be escaped; 1: every character as `\u`; 2: some.
        escapes: u8,
        /// Whitespace between tokens.
        spaced: bool,
    }

    fn write_string(out: &mut String, text: &str, style: Style) {
        out.push('"');
        for (index, ch) in text.chars().enumerate() {
            let escape_all = style.escapes == 1 || (style.escapes == 2 && index % 2 == 0);
            match ch {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '/' if escape_all => out.push_str("\\/"),
                '\n' if !escape_all => out.push_str("\\n"),
                _ if escape_all || u32::from(ch) < 0x20 => {
                    let mut units = [0_u16; 2];
                    for unit in ch.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                _ => out.push(ch),
            }
        }
        out.push('"');
    }

    fn space(out: &mut String, style: Style) {
        if style.spaced {
            out.push_str(" \n\t\r ");
        }
    }

    fn write_value(out: &mut String, value: &Value, style: Style) {
        match value {
            Value::String(text) => write_string(out, text, style),
            Value::Array(items) => {
                out.push('[');
                for (index, item) in items.iter().enumerate() {
                    if index > 0 {
                        out.push(',');
                    }
                    space(out, style);
                    write_value(out, item, style);
                    space(out, style);
                }
                out.push(']');
            }
            Value::Object(members) => {
                let members: Vec<(&String, &Value)> = members.iter().collect();
                write_members(out, &members, style);
            }
            scalar => out.push_str(&scalar.to_string()),
        }
    }

    /// An object from a list of members, duplicates allowed.
    fn write_members(out: &mut String, members: &[(&String, &Value)], style: Style) {
        out.push('{');
        for (index, (name, value)) in members.iter().enumerate() {
            if index > 0 {
                out.push(',');
            }
            space(out, style);
            write_string(out, name, style);
            space(out, style);
            out.push(':');
            space(out, style);
            write_value(out, value, style);
            space(out, style);
        }
        out.push('}');
    }

    fn any_style() -> impl Strategy<Value = Style> {
        (0_u8..3, any::<bool>()).prop_map(|(escapes, spaced)| Style { escapes, spaced })
    }

    /// Top-level members, mostly under the names the readers look for.
    fn any_members() -> impl Strategy<Value = Vec<(String, Value)>> {
        let top = ["usage", "meta", "\u{1F600}", "a\"b", "type", "usage"];
        let name = prop_oneof![
            3 => prop::sample::select(top.to_vec()).prop_map(str::to_string),
            1 => any_key(),
        ];
        let value = prop_oneof![2 => any_usage(), 1 => any_value()];
        prop::collection::vec((name, value), 0..6)
    }

    /// One line of a test event stream.
    fn any_line() -> impl Strategy<Value = String> {
        let event = (any_members(), any_style()).prop_map(|(members, style)| {
            let members: Vec<(&String, &Value)> =
                members.iter().map(|(name, value)| (name, value)).collect();
            let mut out = String::new();
            // Data lines hold no line ends: no whitespace but spaces.
            write_members(
                &mut out,
                &members,
                Style {
                    spaced: false,
                    ..style
                },
            );
            out
        });
        let usage = (
            prop::sample::select(vec![
                "message_start",
                "message_delta",
                "response.completed",
                "chunk",
            ]),
            0_u64..1000,
            0_u64..1000,
        )
            .prop_map(|(kind, input, output)| {
                let usage = format!(
                    "{{\"input_tokens\":{input},\"output_tokens\":{output},\"total_tokens\":1}}"
                );
                match kind {
                    "message_start" => {
                        format!("{{\"type\":\"message_start\",\"message\":{{\"usage\":{usage}}}}}")
                    }
                    "response.completed" => format!(
                        "{{\"type\":\"response.completed\",\"response\":{{\"usage\":{usage}}}}}"
                    ),
                    "message_delta" => format!("{{\"type\":\"message_delta\",\"usage\":{usage}}}"),
                    _ => format!("{{\"choices\":[],\"usage\":{usage},\"meta\":{{\"n\":{input}}}}}"),
                }
            });
        let prefix = prop::sample::select(vec!["data: ", "data:", "data:  ", "dat", "data"]);
        prop_oneof![
            4 => (prefix.clone(), event).prop_map(|(prefix, event)| format!("{prefix}{event}")),
            4 => (prefix, usage).prop_map(|(prefix, usage)| format!("{prefix}{usage}")),
            1 => Just("data: [DONE]".to_string()),
            1 => Just(": comment \u{e9}".to_string()),
            1 => Just("id: 1".to_string()),
            1 => prop::sample::select(vec!["message_delta", "message_start", "x", ""])
                .prop_map(|kind| format!("event: {kind}")),
            1 => Just("data: {\"usage\":".to_string()),
            1 => Just("data: {\"total_tokens\":3}}".to_string()),
            12 => Just(String::new()),
        ]
    }

    proptest! {
        #[test]
        fn json_bodies_read_as_serde_json_reads_them(
            reader in any_reader(),
            members in any_members(),
            style in any_style(),
            truncate in prop::option::weighted(0.2, any::<usize>()),
            points in prop::collection::vec(any::<usize>(), 0..8),
        ) {
            let members: Vec<(&String, &Value)> =
                members.iter().map(|(name, value)| (name, value)).collect();
            let mut body = String::new();
            write_members(&mut body, &members, style);
            let mut body = body.into_bytes();
            if let Some(at) = truncate {
                body.truncate(at % (body.len() + 1));
            }
            let expected = reference_json(&reader, &body);
            prop_assert_eq!(read(&reader, false, &cut(&body, &points), true), expected);
        }

        #[test]
        fn event_streams_read_as_the_plain_splitter_reads_them(
            reader in any_reader(),
            lines in prop::collection::vec((any_line(), 0_usize..3), 0..24),
            bom in any::<bool>(),
            complete in any::<bool>(),
            points in prop::collection::vec(any::<usize>(), 0..12),
        ) {
            let mut body = if bom { BOM.to_vec() } else { Vec::new() };
            for (line, line_end) in &lines {
                body.extend_from_slice(line.as_bytes());
                body.extend_from_slice(["\n", "\r", "\r\n"][*line_end].as_bytes());
            }
            // Sometimes the last line has no line end.
            if lines.len() % 3 == 1 {
                while matches!(body.last(), Some(b'\n' | b'\r')) {
                    body.pop();
                }
            }
            let expected = reference_events(&reader, &body, complete);
            prop_assert_eq!(read(&reader, true, &cut(&body, &points), complete), expected);
        }
    }
}
