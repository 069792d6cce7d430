"""The lab's pictures, drawn with Pillow alone (already a dependency; a heatmap, lines and bars need no more).

Each function returns (image, data): `data` holds the plotted numbers and where they were drawn, in pixels.
It is stored in the PNG as a text chunk, so a test can check that the picture shows the JSON's numbers.
"""

import math

from PIL import Image, ImageDraw, ImageFont

from ddp_no_sync_lab.experiment import COLLECTIVE_KINDS

WHITE = (255, 255, 255)
INK = (33, 33, 33)
GRID = (222, 222, 222)
GRID_DARK = (150, 150, 150)
HEAT = (8, 69, 148)  # the darkest shade of the confusion matrix
MODE_COLOURS = {"every": (31, 119, 180), "no_sync": (227, 111, 30)}
# every is drawn wide and no_sync narrow on top of it, so both stay visible where the two runs agree.
LINE_WIDTHS = {"every": 7, "no_sync": 3}
MARKER_RADII = {"every": 7, "no_sync": 4}


def font(size):
    return ImageFont.load_default(size=size)


def text_size(draw, text, text_font):
    left, top, right, bottom = draw.textbbox((0, 0), text, font=text_font)
    return right - left, bottom - top


def centred_text(draw, centre, text, text_font, fill=INK):
    draw.text(centre, text, font=text_font, fill=fill, anchor="mm")


def vertical_text(image, centre, text, text_font, fill=INK):
    """Text rotated 90 degrees counter-clockwise, centred on `centre`."""
    width, height = text_size(ImageDraw.Draw(image), text, text_font)
    label = Image.new("RGBA", (width + 8, height + 8), (0, 0, 0, 0))
    ImageDraw.Draw(label).text((4, 4), text, font=text_font, fill=fill)
    label = label.rotate(90, expand=True)
    image.paste(label, (round(centre[0] - label.width / 2), round(centre[1] - label.height / 2)), label)


def heat_shade(fraction):
    """White for 0, HEAT for 1, linear between."""
    return tuple(round(255 + (channel - 255) * fraction) for channel in HEAT)


def confusion_matrix_image(matrix, classes, title):
    """A heatmap of counts, rows true and columns predicted; each cell shaded by its share of its row."""
    cell, left, top = 56, 118, 118
    size = len(classes)
    width, height = left + cell * size + 24, top + cell * size + 48
    image = Image.new("RGB", (width, height), WHITE)
    draw = ImageDraw.Draw(image)
    label_font, count_font = font(13), font(14)
    centred_text(draw, (width / 2, 18), title, font(17))
    centred_text(draw, (left + cell * size / 2, 42), "predicted class", font(14))
    vertical_text(image, (16, top + cell * size / 2), "true class", font(14))
    cells = []
    for row, counts in enumerate(matrix):
        row_total = max(sum(counts), 1)
        for column, count in enumerate(counts):
            x0, y0 = left + column * cell, top + row * cell
            fraction = count / row_total
            draw.rectangle((x0, y0, x0 + cell - 1, y0 + cell - 1), fill=heat_shade(fraction), outline=GRID)
            centred_text(draw, (x0 + cell / 2, y0 + cell / 2), str(count), count_font, WHITE if fraction > 0.5 else INK)
            cells.append([x0, y0, x0 + cell - 1, y0 + cell - 1])
    for index, name in enumerate(classes):
        draw.text((left - 8, top + index * cell + cell / 2), name, font=label_font, fill=INK, anchor="rm")
        vertical_text(image, (left + index * cell + cell / 2, top - 36), name, label_font)
    caption = "count in each cell; shade = share of the true class's test images"
    centred_text(draw, (left + cell * size / 2, top + cell * size + 22), caption, font(13))
    return image, {"matrix": matrix, "cells": cells}


def nice_ticks(low, high, count=5):
    """Round tick values covering [low, high]."""
    if high <= low:
        high = low + 1
    raw_step = (high - low) / count
    magnitude = 10 ** math.floor(math.log10(raw_step))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw_step)
    first = math.floor(low / step) * step
    last = math.ceil(high / step) * step
    return [round(first + i * step, 10) for i in range(round((last - first) / step) + 1)]


def tick_label(value):
    if value == 0:
        return "0"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:g}"


class Axes:
    """One panel: a frame, grid, ticks and labels, and the mapping from data to pixels."""

    def __init__(self, image, box, x_range, y_ticks, title, x_label, y_label, x_ticks=None):
        """x_ticks: (value, label) pairs; by default every whole number in x_range (the epochs)."""
        self.image, self.draw = image, ImageDraw.Draw(image)
        self.left, self.top, self.right, self.bottom = box
        self.x_range = x_range
        self.y_range = (y_ticks[0], y_ticks[-1])
        small = font(12)
        for tick in y_ticks:
            y = self.y(tick)
            self.draw.line((self.left, y, self.right, y), fill=GRID)
            self.draw.text((self.left - 6, y), tick_label(tick), font=small, fill=INK, anchor="rm")
        if x_ticks is None:
            x_ticks = [(epoch, str(epoch)) for epoch in range(math.ceil(x_range[0]), math.floor(x_range[1]) + 1)]
        for value, label in x_ticks:
            self.draw.text((self.x(value), self.bottom + 6), label, font=small, fill=INK, anchor="mt")
        self.draw.rectangle(box, outline=INK)
        centred_text(self.draw, ((self.left + self.right) / 2, self.top - 16), title, font(15))
        centred_text(self.draw, ((self.left + self.right) / 2, self.bottom + 30), x_label, font(13))
        vertical_text(image, (self.left - 58, (self.top + self.bottom) / 2), y_label, font(13))

    def x(self, value):
        low, high = self.x_range
        return round(self.left + (value - low) / (high - low) * (self.right - self.left))

    def y(self, value):
        low, high = self.y_range
        return round(self.bottom - (value - low) / (high - low) * (self.bottom - self.top))


def dashed_line(draw, start, end, fill, width, dash=7):
    length = math.dist(start, end)
    pieces = max(int(length // dash), 1)
    for piece in range(0, pieces, 2):
        a, b = piece / pieces, min((piece + 1) / pieces, 1)
        draw.line(
            (
                start[0] + (end[0] - start[0]) * a,
                start[1] + (end[1] - start[1]) * a,
                start[0] + (end[0] - start[0]) * b,
                start[1] + (end[1] - start[1]) * b,
            ),
            fill=fill,
            width=width,
        )


def series_line(draw, start, end, colour, dashed, width=3):
    if dashed:
        dashed_line(draw, start, end, colour, width)
    else:
        draw.line((*start, *end), fill=colour, width=width)


def legend(draw, origin, entries):
    """entries: (label, colour, dashed or None for a filled box) drawn in one row from origin."""
    x, y = origin
    label_font = font(13)
    for label, colour, dashed in entries:
        if dashed is None:
            draw.rectangle((x + 6, y - 8, x + 24, y + 8), fill=colour)
        else:
            series_line(draw, (x, y), (x + 30, y), colour, dashed)
            draw.ellipse((x + 11, y - 4, x + 19, y + 4), fill=colour)
        draw.text((x + 38, y), label, font=label_font, fill=INK, anchor="lm")
        x += 48 + text_size(draw, label, label_font)[0] + 24


def panel_grid(columns, rows, panel_width=430, panel_height=260):
    """Canvas size and each panel's box, leaving room for titles, tick labels and the legend."""
    margin_left, margin_top, gap_x, gap_y = 96, 76, 110, 92
    width = margin_left + columns * panel_width + (columns - 1) * gap_x + 30
    height = margin_top + rows * panel_height + (rows - 1) * gap_y + 84
    boxes = []
    for row in range(rows):
        for column in range(columns):
            left = margin_left + column * (panel_width + gap_x)
            top = margin_top + row * (panel_height + gap_y)
            boxes.append((left, top, left + panel_width, top + panel_height))
    return (width, height), boxes


def titled_canvas(title, columns, rows=1):
    """A white canvas of panel_grid's size with its title, its drawing context, and each panel's box."""
    (width, height), boxes = panel_grid(columns, rows)
    image = Image.new("RGB", (width, height), WHITE)
    draw = ImageDraw.Draw(image)
    centred_text(draw, (width / 2, 20), title, font(18))
    return image, draw, boxes


def line_panels(title, panels):
    """Panels of lines over epochs. panels: [{"title", "y_label", "series": [{"label", "mode", "dashed",
    "values"}]}]; a series is coloured by its mode, every's before no_sync's. Returns (image, data with each
    point's pixel)."""
    image, draw, boxes = titled_canvas(title, len(panels))
    data = []
    for panel, box in zip(panels, boxes):
        values = [value for series in panel["series"] for value in series["values"]]
        epochs = max(len(series["values"]) for series in panel["series"])
        axes = Axes(
            image,
            box,
            (0.5, epochs + 0.5),
            nice_ticks(min(values), max(values)),
            panel["title"],
            "epoch",
            panel["y_label"],
        )
        drawn = []
        for series in panel["series"]:
            colour, radius = MODE_COLOURS[series["mode"]], MARKER_RADII[series["mode"]]
            points = [(axes.x(epoch), axes.y(value)) for epoch, value in enumerate(series["values"], start=1)]
            for start, end in zip(points, points[1:]):
                series_line(draw, start, end, colour, series["dashed"], LINE_WIDTHS[series["mode"]])
            for x, y in points:
                draw.ellipse((x - radius, y - radius, x + radius, y + radius), fill=colour)
            drawn.append(
                {
                    "label": series["label"],
                    "colour": list(colour),
                    "radius": radius,
                    "values": series["values"],
                    "points": points,
                }
            )
        data.append({"title": panel["title"], "series": drawn})
    legend(
        draw,
        (boxes[0][0], image.height - 26),
        [(s["label"], MODE_COLOURS[s["mode"]], s["dashed"]) for s in panels[0]["series"]],
    )
    return image, {"panels": data}


def bar_panels(title, panels, columns=2):
    """Panels of grouped bars per epoch (or per named group: "groups", "x_label"), one bar per mode, from zero.
    panels: [{"title", "y_label", "bars": {mode: [value per epoch]}}]. Returns (image, data with each bar's box)."""
    image, draw, boxes = titled_canvas(title, columns, math.ceil(len(panels) / columns))
    data = []
    for panel, box in zip(panels, boxes):
        modes = list(panel["bars"])
        epochs = max(len(values) for values in panel["bars"].values())
        top_value = max(max(values) for values in panel["bars"].values())
        groups = list(enumerate(panel["groups"], start=1)) if "groups" in panel else None  # named, not epochs
        axes = Axes(
            image,
            box,
            (0.5, epochs + 0.5),
            nice_ticks(0, top_value * 1.08),
            panel["title"],
            panel.get("x_label", "epoch"),
            panel["y_label"],
            groups,
        )
        bar_width = (axes.x(1) - axes.x(0)) * 0.8 / len(modes)
        drawn = {}
        for index, mode in enumerate(modes):
            boxes_drawn = []
            for epoch, value in enumerate(panel["bars"][mode], start=1):
                x0 = round(axes.x(epoch) - bar_width * len(modes) / 2 + index * bar_width)
                bar = [x0, axes.y(value), round(x0 + bar_width) - 1, axes.y(0)]
                draw.rectangle(bar, fill=MODE_COLOURS[mode])
                boxes_drawn.append(bar)
            drawn[mode] = {"values": panel["bars"][mode], "boxes": boxes_drawn, "colour": list(MODE_COLOURS[mode])}
        data.append({"title": panel["title"], "bars": drawn, "zero_y": axes.y(0)})
    legend(draw, (boxes[0][0], image.height - 26), [(mode, MODE_COLOURS[mode], None) for mode in panels[0]["bars"]])
    return image, {"panels": data}


def agreement_image(title, points, bound, caption):
    """Each cell's measured value against its prediction, on the diagonal where they agree, inside the shaded
    band where within `bound` (relative); points: [{"label", "series", "predicted", "measured"}], a colour per
    series, the label beside its point. Returns (image, data with each point's pixel)."""
    (width, height), (box,) = panel_grid(1, 1, panel_width=640, panel_height=440)
    height += 24
    image = Image.new("RGB", (width, height), WHITE)
    draw = ImageDraw.Draw(image)
    centred_text(draw, (width / 2, 20), title, font(18))
    values = [point[key] for point in points for key in ("predicted", "measured")]
    ticks = nice_ticks(min(values) / (1 + bound), max(values) * (1 + bound), count=8)
    axes = Axes(
        image,
        box,
        (ticks[0], ticks[-1]),
        ticks,
        f"the diagonal: exact; shaded: within {bound:.0%}",
        "predicted",
        "measured",
        x_ticks=[(tick, tick_label(tick)) for tick in ticks],
    )
    low, high = ticks[0], ticks[-1]
    wide = 1 + bound  # the band between y = x * wide and y = x / wide, cut to the square of the axes
    band = [
        (low, low),
        (low, min(low * wide, high)),
        (high / wide, high),
        (high, high),
        (high, high / wide),
        (min(low * wide, high), low),
    ]
    draw.polygon([(axes.x(x), axes.y(y)) for x, y in band], fill=GRID)
    draw.line((axes.x(low), axes.y(low), axes.x(high), axes.y(high)), fill=GRID_DARK, width=2)
    draw.rectangle(box, outline=INK)
    series = list(dict.fromkeys(point["series"] for point in points))
    colours = dict(zip(series, (*MODE_COLOURS.values(), (44, 160, 44), (148, 103, 189))))
    drawn = []
    for point in points:
        x, y = axes.x(point["predicted"]), axes.y(point["measured"])
        draw.ellipse((x - 5, y - 5, x + 5, y + 5), fill=colours[point["series"]])
        draw.text((x + 8, y), point["label"], font=font(11), fill=INK, anchor="lm")
        drawn.append({**point, "pixel": [x, y]})
    legend(draw, (box[0], height - 50), [(name, colours[name], False) for name in series])
    draw.text((box[0], height - 22), caption, font=font(13), fill=INK, anchor="lm")
    return image, {"points": drawn, "bound": bound}


COMPUTE_SHADES = ((176, 196, 222), (135, 160, 196))  # alternate micro-batches, so each one's edges show
COLLECTIVE_COLOURS = dict(
    zip(
        COLLECTIVE_KINDS,
        ((214, 39, 40), (148, 103, 189), (255, 127, 14), (44, 160, 44), (127, 127, 127), (140, 86, 75)),
    )
)


def timeline_image(title, panels, caption):
    """One accumulation window per panel, one lane per rank: the micro-batches' spans (compute) in one row and
    the collectives' executions below them, coloured by kind, on one time axis shared by the panels.

    panels: [{"title", "lanes": [{"label", "micro_batches": [[index, start, end]], "collectives": [[kind,
    start, end]]}]}], times in seconds from the window's start. A collective shorter than 3 pixels is drawn 3
    pixels wide, so that every one of them shows. Returns (image, data with each box's pixels)."""
    left, right_margin, lane_height, row_height, gap = 110, 230, 74, 26, 58
    width = 1280
    right = width - right_margin
    end = max(stop for panel in panels for lane in panel["lanes"] for _, _, stop in lane["micro_batches"])
    ticks = nice_ticks(0, end * 1000)
    scale = (right - left) / (ticks[-1] / 1000)
    panel_heights = [len(panel["lanes"]) * lane_height + 30 for panel in panels]
    height = 70 + sum(panel_heights) + gap * len(panels) + 70
    image = Image.new("RGB", (width, height), WHITE)
    draw = ImageDraw.Draw(image)
    centred_text(draw, (width / 2, 20), title, font(18))
    small, label_font = font(12), font(13)

    def x(seconds):
        return round(left + seconds * scale)

    data, top = [], 70
    for panel, panel_height in zip(panels, panel_heights):
        top += gap - 20
        draw.text((left, top - 14), panel["title"], font=font(15), fill=INK, anchor="lm")
        for tick in ticks:
            draw.line((x(tick / 1000), top, x(tick / 1000), top + panel_height - 30), fill=GRID)
            draw.text((x(tick / 1000), top + panel_height - 26), tick_label(tick), font=small, fill=INK, anchor="mt")
        lanes = []
        for number, lane in enumerate(panel["lanes"]):
            lane_top = top + number * lane_height + 6
            compute_row = (lane_top, lane_top + row_height)
            collective_row = (lane_top + row_height + 6, lane_top + 2 * row_height + 6)
            draw.text((left - 10, lane_top + row_height), lane["label"], font=label_font, fill=INK, anchor="rm")
            compute = []
            for shade, (index, start, stop) in enumerate(lane["micro_batches"]):
                box = [x(start), compute_row[0], max(x(stop) - 1, x(start)), compute_row[1]]
                draw.rectangle(box, fill=COMPUTE_SHADES[shade % 2])
                centred_text(draw, ((box[0] + box[2]) / 2, (box[1] + box[3]) / 2), f"micro-batch {index}", small)
                compute.append({"index": index, "box": box})
            collectives = []
            for kind, start, stop in lane["collectives"]:
                box = [x(start), collective_row[0], max(x(stop), x(start) + 2), collective_row[1]]
                draw.rectangle(box, fill=COLLECTIVE_COLOURS[kind])
                collectives.append({"kind": kind, "box": box})
            counts = {kind: sum(c["kind"] == kind for c in collectives) for kind in COLLECTIVE_COLOURS}
            synced = "reduce-scatter" if counts["reduce-scatter"] else "gradient all-reduce"  # FSDP's, or DDP's
            summary = f"{counts[synced]} {synced}(s)" + (
                f", {counts['all-gather']} all-gather(s)" if counts["all-gather"] else ""
            )
            draw.text(
                (right + 12, compute_row[1]), summary, font=label_font, fill=COLLECTIVE_COLOURS[synced], anchor="lm"
            )
            others = (
                f"{counts['rank-agreement all-reduce']} rank agreement, {counts['average-witness all-reduce']} "
                f"average witness, {counts['broadcast']} broadcast(s)"
            )
            draw.text((right + 12, collective_row[1] + 2), others, font=small, fill=INK, anchor="lm")
            lanes.append({"label": lane["label"], "compute": compute, "collectives": collectives, "counts": counts})
        data.append({"title": panel["title"], "lanes": lanes})
        top += panel_height
    centred_text(
        draw, ((left + right) / 2, top + 6), "milliseconds from the window's start (each rank's own clock)", font(13)
    )
    shown = [lane["counts"] for panel in data for lane in panel["lanes"]]  # the legend names the kinds drawn
    legend(
        draw,
        (left - 40, height - 44),
        [("micro-batch: forward, backward, step", COMPUTE_SHADES[0], None)]
        + [(kind, colour, None) for kind, colour in COLLECTIVE_COLOURS.items() if any(drawn[kind] for drawn in shown)],
    )
    draw.text((left - 40, height - 16), caption, font=small, fill=INK, anchor="lm")
    return image, {"panels": data, "origin_x": left, "seconds_per_pixel": 1 / scale}


def index_panels(title, panels):
    """Panels of values against their index (micro-batches, windows), side by side. panels: [{"title", "x_label",
    "y_label", "series": [{"label", "colour", "values"}]}]. Returns (image, data with each point's pixel)."""
    image, draw, boxes = titled_canvas(title, len(panels))
    data = []
    for panel, box in zip(panels, boxes):
        values = [value for series in panel["series"] for value in series["values"]]
        count = max(len(series["values"]) for series in panel["series"])
        x_ticks = [(tick, tick_label(tick)) for tick in nice_ticks(0, count - 1) if tick <= count - 1]
        axes = Axes(
            image,
            box,
            (-0.5, count - 0.5),
            nice_ticks(min(values), max(values)),
            panel["title"],
            panel["x_label"],
            panel["y_label"],
            x_ticks,
        )
        drawn = []
        for series in panel["series"]:
            points = [(axes.x(index), axes.y(value)) for index, value in enumerate(series["values"])]
            for start, end in zip(points, points[1:]):
                draw.line((*start, *end), fill=tuple(series["colour"]), width=1)
            for x, y in points:
                draw.ellipse((x - 2, y - 2, x + 2, y + 2), fill=tuple(series["colour"]))
            drawn.append({"label": series["label"], "values": series["values"], "points": points})
        data.append({"title": panel["title"], "series": drawn})
    labels = {series["label"]: tuple(series["colour"]) for panel in panels for series in panel["series"]}
    legend(draw, (boxes[0][0], image.height - 26), [(label, colour, False) for label, colour in labels.items()])
    return image, {"panels": data}
