"""The web dashboard in a real headless Chromium (Debian's `chromium`, driven by playwright):
it loads, lists a client connected with paho, and its kick button disconnects that client."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.conftest import ThreadedBroker, free_port, serve_admin
from tests.mqtt_clients import Paho

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
MQTT_ADMINISTRATIVE_ACTION = 0x98
TIMEOUT_MS = 15_000

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium browser installed")


@pytest.fixture
def node(broker_factory: Callable[..., ThreadedBroker]) -> Iterator[tuple[ThreadedBroker, str]]:
    broker = broker_factory(listeners={"http_port": free_port(), "grpc_port": free_port()},
                            archive={"enabled": False})
    for url in serve_admin(broker):
        yield broker, url


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser: Any, node: tuple[ThreadedBroker, str]) -> Iterator[Any]:
    context = browser.new_context()
    try:
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
        page.errors = errors
        yield page
        # a route handler still running (the page polls while the test ends) would otherwise
        # run on after the context closed, and raise in the next test's call to the browser
        page.unroute_all(behavior="wait")
    finally:
        context.close()


def test_dashboard_loads_with_overview_streams_and_live_chart(
    node: tuple[ThreadedBroker, str], page: Any
) -> None:
    broker, url = node
    publisher = Paho(broker.mqtt_port, "chart-feeder")
    try:
        page.goto(url + "/")
        expect = sync_api.expect
        expect(page).to_have_title("Shardgate")
        expect(page.locator("#link-state")).to_have_text("live")
        expect(page.locator("#version")).to_contain_text("v0.")
        for i in range(20):
            publisher.publish("chart/x", str(i), qos=1)
        expect(page.locator("#streams-body tr[data-stream='default']")).to_have_count(1)
        expect(page.locator("#connections")).to_have_text("1")
        expect(page.locator("#archive-body")).to_contain_text("not configured")
        # this node's resources: resident memory, descriptors, free disk, no alarm
        expect(page.locator("#node-memory")).to_contain_text("MiB")
        expect(page.locator("#node-descriptors")).not_to_have_text("–")
        expect(page.locator("#node-disk")).to_contain_text("B")
        expect(page.locator("#node-alarms")).to_have_text("none")
        # Rates need two samples; the chart is drawn on a canvas with some non-blank pixels.
        expect(page.locator("#rate-in")).not_to_have_text("–")
        page.wait_for_function(
            """() => {
                const c = document.getElementById('rate-chart');
                const data = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                for (let i = 3; i < data.length; i += 4) if (data[i] !== 0) return true;
                return false;
            }"""
        )
    finally:
        publisher.client.disconnect()
    assert page.errors == []


def test_kick_button_disconnects_the_client(node: tuple[ThreadedBroker, str], page: Any) -> None:
    broker, url = node
    victim_id = "<img src=x onerror=alert(1)>"  # a client id is untrusted input
    victim = Paho(broker.mqtt_port, victim_id)
    bystander = Paho(broker.mqtt_port, "bystander")
    try:
        page.goto(url + "/")
        expect = sync_api.expect
        row = page.locator("#clients-body tr").filter(
            has=page.locator("code.client-id", has_text=victim_id)
        )
        expect(row).to_have_count(1)
        expect(row).to_contain_text("MQTT 5.0")
        expect(page.locator("#clients-body img")).to_have_count(0)

        row.get_by_role("button", name="Kick").click()

        reason, _props = victim.disconnects.get(timeout=10)
        assert reason == MQTT_ADMINISTRATIVE_ACTION
        expect(page.locator("#kick-status")).to_contain_text(f"Kicked mqtt client {victim_id}")
        expect(row).to_have_count(0)
        bystander_row = page.locator("#clients-body tr[data-client-id='bystander']")
        expect(bystander_row).to_have_count(1)
        assert bystander.disconnects.empty()
    finally:
        victim.client.loop_stop()
        bystander.client.disconnect()
    assert page.errors == []


def test_chart_draws_the_server_history_on_load_archive_table_and_session_expiry(
    broker_factory: Callable[..., ThreadedBroker], page: Any,
) -> None:
    import json
    import urllib.request

    from tests.conftest import wait_for
    from tests.mqtt_clients import V311

    broker = broker_factory(listeners={"http_port": free_port()})
    url = f"http://127.0.0.1:{broker.app.port('http')}"
    history = broker.app.listeners["http"].server.history
    publisher = Paho(broker.mqtt_port, "history-feeder")
    for i in range(30):
        publisher.publish("history/x", str(i), qos=1)
    publisher.client.disconnect()
    broker.call(history.sample)  # as the sampler does every few seconds
    with urllib.request.urlopen(url + "/api/history", timeout=10) as response:
        served = json.loads(response.read())
    assert served["span_s"] == 900 and len(served["samples"]) >= 2
    assert served["samples"][-1]["messages_in"] - served["samples"][0]["messages_in"] >= 30

    sleeper = Paho(broker.mqtt_port, "sleeper-311", V311, clean=False)
    sleeper.subscribe("history/#", 1)
    sleeper.client.disconnect()
    wait_for(lambda: "sleeper-311" in broker.app.mqtt.sessions
             and broker.app.mqtt.sessions["sleeper-311"].connection is None)

    page.goto(url + "/")
    expect = sync_api.expect
    # The chart starts with the server's history: points older than the page.
    page.wait_for_function("() => samples.length >= 1 && samples[0].in > 0")
    assert page.evaluate("() => samples[0].t") < served["samples"][-1]["t"] + 0.001
    expect(page.locator("#chart-window")).to_have_text("15m 0s")

    session = page.locator("#sessions-body tr[data-client-id='sleeper-311']")
    expect(session).to_contain_text("never")
    expect(session).not_to_contain_text("49710d")

    archive = page.locator("#archive-body table #archive-shards tr[data-stream='default']")
    expect(archive).to_have_count(1)
    expect(page.locator("#archive-body")).not_to_contain_text('{"')
    assert page.errors == []


def test_offline_session_backlog_publisher_only_clients_and_a_queue_without_consumers(
    broker_factory: Callable[..., ThreadedBroker], page: Any,
) -> None:
    """An offline persistent session shows its backlog as Queued (its subscription's lag); a
    client that only publishes is not a subscription; an AMQP queue nobody consumes has no
    consumer (the queue is not its own consumer)."""
    import pika

    from tests.conftest import wait_for
    from tests.mqtt_clients import V311

    amqp_port = free_port()
    broker = broker_factory(listeners={"http_port": free_port(), "amqp_port": amqp_port},
                            archive={"enabled": False})
    url = f"http://127.0.0.1:{broker.app.port('http')}"
    away = Paho(broker.mqtt_port, "away-311", V311, clean=False)
    away.subscribe("backlog/#", 1)
    away.client.disconnect()
    wait_for(lambda: broker.app.mqtt.sessions["away-311"].connection is None)
    talker = Paho(broker.mqtt_port, "only-publishes", V311, clean=False)
    for i in range(5):
        talker.publish("backlog/x", str(i), qos=1)
    talker.client.disconnect()
    connection = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", amqp_port))
    connection.channel().queue_declare("idle-queue", durable=True)

    page.goto(url + "/")
    expect = sync_api.expect
    session = page.locator("#sessions-body tr[data-client-id='away-311'] td.num").first
    expect(session).to_have_text("5")
    expect(page.locator("#subscriptions-body tr[data-subscription='mqtt:away-311']")).to_have_count(1)
    expect(page.locator("#subscriptions-body tr[data-subscription='mqtt:only-publishes']")).to_have_count(0)
    queue = page.locator("#subscriptions-body tr[data-subscription='amqp:/:idle-queue']")
    expect(queue).to_contain_text("none")
    connection.close()
    assert page.errors == []


# Records what the chart writes on its canvas (the time axis is drawn text, not DOM).
RECORD_CANVAS_TEXT = """
    window.canvasTexts = [];
    const fillText = CanvasRenderingContext2D.prototype.fillText;
    CanvasRenderingContext2D.prototype.fillText = function (text, x, y, ...rest) {
        window.canvasTexts.push({text: String(text), x, y, baseline: this.textBaseline});
        return fillText.call(this, text, x, y, ...rest);
    };
"""


def test_rate_cards_average_ten_seconds_and_the_chart_has_a_time_axis(
    node: tuple[ThreadedBroker, str], page: Any,
) -> None:
    """The broker's /api/info answers go through the page unchanged but for their clock and
    message counter: each poll is 2 s later, and 100 messages arrive at once every 10 s. The
    rate cards show the 10 s average, 10/s, at every poll (a one-poll instant would show 50
    and 0); the chart's time axis writes five clock times across its 15-minute window, the
    newest at the right."""
    import time

    _broker, url = node
    base = time.time()
    polls: list[float] = []

    def info(route: Any) -> None:
        answer = route.fetch().json()
        k = len(polls)
        answer["now"] = base + 2 * k
        answer["messages_in"] = 100 * ((2 * k) // 10)
        polls.append(answer["now"])
        route.fulfill(json=answer)

    page.add_init_script(RECORD_CANVAS_TEXT)
    page.route("**/api/info", info)
    page.goto(url + "/")
    shown = []
    for k in range(6, 12):  # from the first poll whose 10 s window is full
        page.wait_for_function(f"() => recentInfo.length && recentInfo.at(-1).now >= {base + 2 * k}")
        shown.append(page.locator("#rate-in").text_content())
    assert shown == ["10"] * len(shown)

    newest = page.evaluate("() => samples.at(-1).t")
    page.evaluate("() => { window.canvasTexts = []; drawChart(); }")
    labels = [entry["text"] for entry in page.evaluate("() => window.canvasTexts")
              if entry["baseline"] == "top"]
    clock = page.evaluate(
        """(ts) => ts.map((t) => new Date(t * 1000).toLocaleTimeString(
               [], {hour: "2-digit", minute: "2-digit"}))""",
        [newest - 900 + 225 * i for i in range(5)])
    assert labels == clock and len(set(labels)) == 5, labels
    sync_api.expect(page.locator("#chart-window")).to_have_text("15m 0s")
    assert page.errors == []


def test_overview_shows_an_active_disk_alarm(
    broker_factory: Callable[..., ThreadedBroker], page: Any,
) -> None:
    broker = broker_factory(listeners={"http_port": free_port()}, archive={"enabled": False},
                            disk_free_limit=1 << 60)
    page.goto(f"http://127.0.0.1:{broker.app.port('http')}/")
    alarms = page.locator("#node-alarms")
    sync_api.expect(alarms).to_have_text("disk")
    sync_api.expect(alarms).to_have_class("value lagging")
    sync_api.expect(page.locator("#node-disk-limit")).to_contain_text("limit")
    # the node table too: its one row (a single node) shows the alarm
    row = page.locator("#nodes-body tr[data-node='this node']")
    sync_api.expect(row).to_have_attribute("data-alarms", "disk")
    sync_api.expect(row).to_contain_text("MiB")
    assert page.errors == []


def test_clients_table_searches_and_pages_fifty_at_a_time(
    node: tuple[ThreadedBroker, str], page: Any,
) -> None:
    """One real client among 120 more the page is told of (the broker's /api/clients answer,
    lengthened on its way): 50 a page, the search box keeps those whose id, user, protocol or
    remote hold every word typed."""
    broker, url = node
    needle = Paho(broker.mqtt_port, "needle-in-haystack")
    made_up = [
        {"protocol": "amqp" if i % 2 else "grpc", "client_id": f"hay-{i:03d}",
         "username": "alice" if i % 3 == 0 else None, "remote": f"10.0.0.{i}:5000",
         "transport": "tcp", "connected_at": 0, "messages_in": 0, "messages_out": 0,
         "detail": "", "kickable": False}
        for i in range(120)
    ]

    def clients(route: Any) -> None:
        route.fulfill(json=route.fetch().json() + made_up)

    try:
        page.route("**/api/clients", clients)
        page.goto(url + "/")
        expect = sync_api.expect
        rows = page.locator("#clients-body tr")
        status = page.locator("#clients-page")
        expect(status).to_have_text("1–50 of 121")
        expect(rows).to_have_count(50)
        expect(page.locator("#clients-prev")).to_be_disabled()
        page.locator("#clients-next").click()
        expect(status).to_have_text("51–100 of 121")
        page.locator("#clients-next").click()
        expect(status).to_have_text("101–121 of 121")
        expect(rows).to_have_count(21)
        expect(page.locator("#clients-next")).to_be_disabled()

        search = page.locator("#client-search")
        search.fill("needle")
        expect(status).to_have_text("1–1 of 1 (121 connected)")
        expect(rows).to_have_count(1)
        expect(rows.first).to_have_attribute("data-client-id", "needle-in-haystack")
        search.fill("alice amqp")  # every word: i odd and a multiple of 3, 20 of them
        expect(status).to_have_text("1–20 of 20 (121 connected)")
        search.fill("nobody-by-this-name")
        expect(page.locator("#clients-body td.empty")).to_have_text("No client matches")
        search.fill("")
        expect(status).to_have_text("1–50 of 121")
    finally:
        needle.client.disconnect()
    assert page.errors == []


def test_purge_and_replay_buttons_move_a_durable_subscriptions_cursors(
    node: tuple[ThreadedBroker, str], page: Any,
) -> None:
    """An offline persistent session has 5 messages waiting: Purge (confirmed) skips them,
    Replay brings them back; a dismissed confirmation changes nothing; a live-only
    subscription has no buttons."""
    from tests.conftest import wait_for
    from tests.mqtt_clients import V311

    broker, url = node
    away = Paho(broker.mqtt_port, "away-purge", V311, clean=False)
    away.subscribe("purge/#", 1)
    away.client.disconnect()
    wait_for(lambda: broker.app.mqtt.sessions["away-purge"].connection is None)
    live = Paho(broker.mqtt_port, "live-watcher")  # MQTT 5, session expiry 0: live-only
    live.subscribe("purge/#", 1)
    for i in range(5):
        live.publish("purge/x", str(i), qos=1)
    answers: list[bool] = []
    questions: list[str] = []

    def on_dialog(dialog: Any) -> None:
        questions.append(dialog.message)
        if answers.pop(0):
            dialog.accept()
        else:
            dialog.dismiss()

    page.on("dialog", on_dialog)
    try:
        page.goto(url + "/")
        expect = sync_api.expect
        row = page.locator("#subscriptions-body tr[data-subscription='mqtt:away-purge']")
        lag = row.locator("td.num").first
        expect(lag).to_have_text("5")
        live_row = page.locator("#subscriptions-body tr[data-subscription='mqtt:live-watcher']")
        expect(live_row).to_have_count(1)
        expect(live_row.get_by_role("button")).to_have_count(0)

        answers.append(False)
        row.get_by_role("button", name="Purge").click()
        wait_for(lambda: questions)
        assert "5 waiting messages" in questions[0]
        assert broker.call(_lag(broker, "mqtt:away-purge")) == 5

        answers.append(True)
        row.get_by_role("button", name="Purge").click()
        expect(page.locator("#subscription-status")).to_have_text(
            "Purged mqtt:away-purge: 5 messages skipped")
        expect(lag).to_have_text("0")

        answers.append(True)
        row.get_by_role("button", name="Replay").click()
        expect(page.locator("#subscription-status")).to_contain_text("Replaying mqtt:away-purge")
        expect(lag).to_have_text("5")
    finally:
        live.client.disconnect()
    assert page.errors == []


async def _lag(broker: ThreadedBroker, name: str) -> int:
    return int(broker.app.edge.subscriptions[name].lag())


def test_retained_browser_lists_payload_previews_under_a_prefix(
    node: tuple[ThreadedBroker, str], page: Any,
) -> None:
    broker, url = node
    publisher = Paho(broker.mqtt_port, "retainer")
    try:
        publisher.publish("sensors/kitchen/temp", "21.5", qos=1, retain=True)
        publisher.publish("sensors/hall/temp", "<b>19</b>", qos=1, retain=True)
        publisher.publish("status/gateway", bytes([0xff, 0x00, 0xfe]), qos=1, retain=True)
        page.goto(url + "/")
        expect = sync_api.expect
        rows = page.locator("#retained-body tr")
        # every retained topic, the broker's own $SYS ones too
        expect(page.locator("#retained-body tr[data-topic^='$SYS/']").first).to_be_attached()
        expect(page.locator("#retained-count")).to_have_text(re.compile(r"^\d+ retained$"))
        kitchen = page.locator("#retained-body tr[data-topic='sensors/kitchen/temp']")
        expect(kitchen).to_contain_text("21.5")
        hall = page.locator("#retained-body tr[data-topic='sensors/hall/temp'] code.payload")
        expect(hall).to_have_text("<b>19</b>")  # shown as text, never parsed as HTML
        expect(page.locator("#retained-body b")).to_have_count(0)
        gateway = page.locator("#retained-body tr[data-topic='status/gateway']")
        expect(gateway).to_contain_text("/wD+")
        expect(gateway).to_contain_text("(base64)")

        page.locator("#retained-prefix").fill("sensors/")
        expect(rows).to_have_count(2)
        expect(page.locator("#retained-count")).to_have_text("2 retained")
        page.locator("#retained-prefix").fill("nothing/")
        # (a locator of the one empty-table cell: a text check of several rows fails at once)
        expect(page.locator("#retained-body td.empty")).to_have_text(
            "No retained message under this prefix")
        expect(rows).to_have_count(1)
    finally:
        publisher.client.disconnect()
    assert page.errors == []


def test_each_stream_shows_its_message_rate(node: tuple[ThreadedBroker, str], page: Any) -> None:
    """The broker's /api/streams answers go through the page with the default stream's
    message count growing 10 a second of real time: its rate reads about 10/s."""
    import time

    _broker, url = node
    base = time.time()

    def streams(route: Any) -> None:
        answer = route.fetch().json()
        for stream in answer:
            if stream["name"] == "default":
                stream["messages"] = int(10 * (time.time() - base))
        route.fulfill(json=answer)

    page.route("**/api/streams", streams)
    page.goto(url + "/")
    rate = page.locator("#streams-body tr[data-stream='default'] td.rate").first
    sync_api.expect(rate).not_to_have_text("–")
    page.wait_for_function("() => (streamCounts.get('default') || []).length >= 4")
    assert 7 <= float(rate.text_content() or "0") <= 13, rate.text_content()
    assert page.errors == []
